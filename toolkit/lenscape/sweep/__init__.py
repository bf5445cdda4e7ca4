"""The sweep machinery every per-prompt method runs on.

``backend`` (the seam: nnsight, TransformerLens or plain torch hooks, one ``Backend``
protocol) <- ``inputs`` (tokenise, pad, batch) <- ``plan`` (a method as data: options,
pre-pass, batch function) <- ``distributed`` (dask) <- ``streaming`` (resumable writes to a
store) ; ``memory`` sizes batches, ``metrics`` names what is measured, ``result`` turns
scores into a validated DataArray. Nothing here knows a particular method.
"""
