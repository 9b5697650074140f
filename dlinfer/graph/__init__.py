"""Graph mode: dlinfer's torch.compile backend and the passes that rewrite unfused patterns.

`torch.compile(model, backend="dlinfer")` works once dlinfer is installed (entry point
`torch_dynamo_backends`); `dlinfer.graph.dlinfer_backend` is the same function. See docs/graph.md.
"""

from dlinfer.graph.backend import dlinfer_backend

__all__ = ["dlinfer_backend"]
