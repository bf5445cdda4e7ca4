"""Group prompts by meaning: embed them, then k-means the embeddings.

``embed`` mean-pools the last hidden state of the bundled sentence encoder
(all-MiniLM-L6-v2, ``encoder="minilm"``) or of a ``LensModel``'s own final layer, and
L2-normalises. ``kmeans`` returns a ``Clustering``: labels as a DataArray over ``prompt``
(with ``text``/``category`` coords), the centroids and the encoder, so new prompts can be
routed to their nearest cluster (``Clustering.route``). ``split`` holds texts out of both
clustering and training, for judging routed masks on inputs they never saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xarray as xr

from . import _validate
from .data import PromptSet, as_texts
from .models import LensModel, bundled_folder
from .models.bundled import quiet_loading


@torch.no_grad()
def embed(prompts: Any, encoder: str | LensModel = "minilm", *, batch_size: int = 32) -> np.ndarray:
    """Embed prompts; returns (prompt, d) float32, rows of unit length.

    Args:
        prompts: a ``PromptSet`` or a list of strings.
        encoder: ``"minilm"`` (bundled sentence encoder) or a ``LensModel`` (mean of its
            final hidden states over real tokens).
    """
    from transformers import AutoModel, AutoTokenizer

    batch_size = _validate.positive_int("batch_size", batch_size)
    texts = as_texts(prompts)
    if not texts:
        raise ValueError("No prompts to embed; pass a PromptSet or a list of strings.")
    device: str | torch.device
    if isinstance(encoder, LensModel):
        model, tokenizer, device = encoder.hf, encoder.tokenizer, encoder.device
    elif encoder == "minilm":
        folder = bundled_folder("minilm")
        with quiet_loading():
            model = AutoModel.from_pretrained(folder, local_files_only=True).eval()
        tokenizer, device = AutoTokenizer.from_pretrained(folder, local_files_only=True), "cpu"
    else:
        raise ValueError(f"Unknown encoder {encoder!r}; use 'minilm' or a model from lsc.load.")
    rows = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(
            texts[start : start + batch_size],
            padding=True,
            truncation=True,
            max_length=256,
            return_tensors="pt",
        ).to(device)
        out = model(**batch, output_hidden_states=True)
        hidden = out.hidden_states[-1].float()
        mask = batch["attention_mask"][..., None].float()
        rows.append(((hidden * mask).sum(1) / mask.sum(1)).cpu())
    vectors = torch.cat(rows)
    return torch.nn.functional.normalize(vectors, dim=-1).numpy()


#: Share of a cluster's prompts one kind of text needs to name the cluster (``Clustering.names``).
DOMINANT = 0.5


@dataclass
class Clustering:
    """k-means result.

    Attributes:
        labels: DataArray (prompt,) of cluster ids, with ``text``/``category`` coords.
        centroids: (cluster, d) array.
        encoder: what embedded the prompts (``"minilm"`` or a ``LensModel``), used by
            ``route`` to embed new inputs the same way.
    """

    labels: xr.DataArray
    centroids: np.ndarray
    encoder: Any = "minilm"

    @property
    def k(self) -> int:
        return len(self.centroids)

    def assign(self, embeddings: np.ndarray) -> np.ndarray:
        """Nearest centroid for each row of ``embeddings`` (n, d) -> (n,) cluster ids."""
        distances = ((np.asarray(embeddings)[:, None] - self.centroids[None]) ** 2).sum(-1)
        return distances.argmin(1)

    def route(self, prompts: Any) -> np.ndarray:
        """Embed new prompts (a ``PromptSet`` or strings) with this clustering's encoder and
        return each one's nearest cluster, (n,) ints."""
        return self.assign(embed(prompts, self.encoder))

    def names(self, *, dominant: float = DOMINANT) -> xr.DataArray:
        """Name each cluster by the kind of text it holds: its most common ``category`` and
        that kind's share of its prompts ("3: code 92%"), or "3: mixed (facts 40%)" when no
        kind reaches ``dominant``. Computed from the labels, never typed.

        Args:
            dominant: the share a kind needs to name its cluster, in (0, 1].

        Returns:
            DataArray (cluster,) of names, coords 0..k-1 (assign it to a result's
            ``cluster`` dim and pass ``tick_labels={"cluster": ...}`` to ``lsc.heatmap``).

        Raises:
            ValueError: the clustering was made without its prompts (no ``category`` coord:
                pass ``prompts=`` to ``kmeans``), or ``dominant`` outside (0, 1].
        """
        dominant = _validate.number("dominant", dominant, above=0.0, high=1.0)
        if "category" not in self.labels.coords:
            raise ValueError(
                "The clustering does not know its prompts' kinds; make it with "
                "cluster.kmeans(embeddings, k, prompts=prompts)."
            )
        kinds = self.labels["category"].values
        names = []
        for c in range(self.k):
            held, counts = np.unique(kinds[self.labels.values == c], return_counts=True)
            top = int(np.argmax(counts))  # ties: the first kind in alphabetical order
            share = f"{held[top]} {counts[top] / counts.sum():.0%}"
            names.append(
                f"{c}: {share}"
                if counts[top] >= dominant * counts.sum()
                else f"{c}: mixed ({share})"
            )
        return xr.DataArray(
            names, dims=("cluster",), coords={"cluster": np.arange(self.k)}, name="cluster_name"
        )

    def members(self, prompts: PromptSet, cluster: int) -> PromptSet:
        """The prompts of one cluster."""
        return PromptSet(
            [p for p, c in zip(prompts, self.labels.values, strict=True) if c == cluster],
            name=f"{prompts.name}:cluster{cluster}",
        )


def kmeans(
    embeddings: np.ndarray,
    k: int,
    *,
    seed: int = 0,
    prompts: PromptSet | None = None,
    encoder: str | LensModel = "minilm",
) -> Clustering:
    """k-means (scikit-learn, 10 restarts) of (prompt, d) embeddings into ``k`` clusters.

    Args:
        embeddings: (prompt, d) from ``embed``.
        k: number of clusters.
        seed: seeds k-means.
        prompts: the embedded prompts, to label the result with their texts and kinds.
        encoder: the encoder ``embed`` used, so ``Clustering.route`` embeds new inputs alike.

    Raises:
        ValueError: k < 1, k larger than the number of prompts, or a cluster left empty.
    """
    from sklearn.cluster import KMeans

    k = _validate.positive_int("k", k)
    seed = _validate.seed("seed", seed)
    shape = _validate.values("embeddings", embeddings, fix="pass cluster.embed(prompts)").shape
    if len(shape) != 2:
        raise ValueError(
            f"embeddings must be (prompt, d), got shape {shape}; pass cluster.embed(prompts)."
        )
    n = len(embeddings)
    if not 1 <= k <= n:
        raise ValueError(
            f"k={k} clusters for {n} prompts: k must be between 1 and the number "
            "of prompts; use fewer clusters or more prompts."
        )
    fit = KMeans(n_clusters=k, n_init=10, random_state=seed).fit(embeddings)
    counts = np.bincount(fit.labels_, minlength=k)
    if (counts == 0).any():
        raise ValueError(
            f"k-means left cluster(s) {np.flatnonzero(counts == 0).tolist()} empty "
            "(too many duplicate prompts for this k); lower k."
        )
    coords: dict[str, Any] = {"prompt": np.arange(n)}
    if prompts is not None:
        coords.update(text=("prompt", prompts.texts), category=("prompt", prompts.categories))
    labels = xr.DataArray(
        fit.labels_.astype(np.int64),
        dims=("prompt",),
        coords=coords,
        attrs={"long_name": "cluster", "k": k, "seed": seed},
    )
    return Clustering(labels, fit.cluster_centers_.astype(np.float32), encoder)


def split(
    prompts: PromptSet, *, held_out: float = 0.25, seed: int = 0
) -> tuple[PromptSet, PromptSet]:
    """Split prompts into (train, held_out) by a seeded shuffle, keeping each kind's share.

    The held-out part is for judging masks on unseen inputs: never cluster or train on it.

    Args:
        held_out: share of each ``category`` held out, in (0, 1).
        seed: seeds the shuffle.
    """
    held_out = _validate.number("held_out", held_out, above=0)
    seed = _validate.seed("seed", seed)
    if not held_out < 1:
        raise ValueError(f"held_out must lie in (0, 1), got {held_out}; e.g. 0.25.")
    rng = np.random.default_rng(seed)
    categories = np.asarray(prompts.categories)
    chosen = np.zeros(len(prompts), dtype=bool)
    for category in dict.fromkeys(categories):
        members = np.flatnonzero(categories == category)
        chosen[rng.permutation(members)[: round(held_out * len(members))]] = True
    return (
        PromptSet(
            [p for p, c in zip(prompts, chosen, strict=True) if not c], name=f"{prompts.name}:train"
        ),
        PromptSet(
            [p for p, c in zip(prompts, chosen, strict=True) if c], name=f"{prompts.name}:held_out"
        ),
    )
