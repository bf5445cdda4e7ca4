"""Embedding prompts, k-means clusters, routing to the nearest centroid, held-out splits
(``cluster.py``); ``mixed`` and ``clusters`` come from conftest.py."""

from __future__ import annotations

import numpy as np
import pytest

from lenscape import cluster


def test_embed_and_kmeans(mixed, clusters):
    emb = cluster.embed(mixed)
    assert emb.shape == (32, 384)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1, rtol=1e-5)
    assert clusters.labels.dims == ("prompt",) and "category" in clusters.labels.coords
    assert sorted(set(clusters.labels.values)) == [0, 1, 2, 3]
    np.testing.assert_array_equal(clusters.assign(emb), clusters.labels.values)
    np.testing.assert_array_equal(clusters.route(mixed.texts), clusters.labels.values)


def test_kmeans_errors(mixed):
    emb = cluster.embed(mixed[:3])
    with pytest.raises(ValueError, match="k=5 clusters for 3 prompts"):
        cluster.kmeans(emb, 5)
    with pytest.raises(ValueError, match="left cluster"):
        cluster.kmeans(np.repeat(emb[:1], 4, axis=0), 2)


def test_split_holds_out_each_kind(mixed):
    train, held_out = cluster.split(mixed, held_out=0.25, seed=0)
    assert len(train) == 24 and len(held_out) == 8
    assert not set(train.texts) & set(held_out.texts)
    assert sorted(held_out.categories) == sorted(set(mixed.categories))  # one of each kind
    assert cluster.split(mixed, seed=1)[1].texts != held_out.texts
    with pytest.raises(ValueError, match=r"held_out must lie in \(0, 1\)"):
        cluster.split(mixed, held_out=1.0)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda e: cluster.kmeans(e, 2.0), TypeError, r"k must be a positive integer, got 2\.0"),
        (
            lambda e: cluster.kmeans(e, 2, seed=-1),
            ValueError,
            r"seed must be a whole number from 0",
        ),
        (lambda e: cluster.kmeans(e * np.nan, 2), ValueError, r"embeddings holds \d+ NaN"),
        (lambda e: cluster.kmeans(e[0], 2), ValueError, r"embeddings must be \(prompt, d\)"),
        (lambda e: cluster.kmeans("abc", 2), TypeError, r"embeddings must be an array of numbers"),
    ],
)
def test_kmeans_checks_its_inputs(call, error, message):
    embeddings = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    with pytest.raises(error, match=message):
        call(embeddings)


def test_split_and_embed_check_their_options(mixed):
    with pytest.raises(ValueError, match=r"held_out must be a finite number > 0, got nan"):
        cluster.split(mixed, held_out=float("nan"))
    with pytest.raises(TypeError, match=r"held_out must be a number > 0, got '0\.25'"):
        cluster.split(mixed, held_out="0.25")
    with pytest.raises(ValueError, match=r"batch_size must be a positive integer, got 0"):
        cluster.embed(mixed, batch_size=0)


def test_clusters_are_named_by_the_kind_of_text_they_hold(mixed, clusters):
    """A cluster's name is its most common kind with that kind's share, computed from the
    labels; "mixed" when no kind holds half of it."""
    names = clusters.names()
    assert names.dims == ("cluster",) and list(names["cluster"].values) == [0, 1, 2, 3]
    for c, name in enumerate(names.values):
        kinds = clusters.labels["category"].values[clusters.labels.values == c]
        held, counts = np.unique(kinds, return_counts=True)
        share = f"{held[counts.argmax()]} {counts.max() / counts.sum():.0%}"
        assert name in (f"{c}: {share}", f"{c}: mixed ({share})")
        assert name.startswith(f"{c}: mixed") == (counts.max() < 0.5 * counts.sum())
    assert all(
        n.startswith(f"{c}: mixed")
        for c, n in enumerate(clusters.names(dominant=1.0).values)
        if "100%" not in n
    )
    bare = cluster.kmeans(cluster.embed(mixed[:8]), 2)  # made without its prompts
    with pytest.raises(ValueError, match=r"prompts=prompts"):
        bare.names()
    with pytest.raises(ValueError, match="dominant must be"):
        clusters.names(dominant=0)
