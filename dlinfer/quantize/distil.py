"""The tuning that ends AWQ: the values an AWQ checkpoint stores in floating point (each 4-bit
group's float16 scale, and the RMSNorm weights) are trained so that the quantised model's
next-token distributions match the float model's on the tuning samples: distillation
(docs/quantize.md, "The tuning").

AWQ's scale and clipping searches fit each linear alone to its own output error; this stage sees
the whole model and the quantity perplexity measures. The 4-bit codes and zero points stay what
AWQ chose; a group's dequantised weights `(q - z) * s` move only through its scale `s`, trained as
`s0 * (1 + d)` (d starts at 0), and the norms through their weights. The checkpoint's format is
unchanged: the scales are rounded to their stored dtype before the result is measured.

Targets: the float model's log-probabilities of each sample's next tokens, taken before any layer
is quantised, kept as each position's `TOP_K` most likely tokens plus one bin for the rest of the
vocabulary (memory S x T x (TOP_K + 1) instead of S x T x V; the student's distribution is
coarsened to the same bins). Loss: KL(float || quantised) over those bins, mean over positions.
Adam, `LR`, `STEPS` steps of `BATCH` samples each (the samples shuffled once per pass). The KL over
all tuning samples is measured before and after: a tuning that did not lower it is undone, so
the stage never makes its own objective worse.
"""

from __future__ import annotations

TOP_K = 64
LR = 1e-3
STEPS = 30
BATCH = 16
_FLOOR = -100.0  # log-probabilities below this count as zero mass (an empty tail bin is -inf)


def coarse_log_probs(logits, top):
    """`logits [..., V]`, `top [..., k]` token ids -> `[..., k + 1]` log-probabilities: the k
    tokens', then the rest of the vocabulary's (floored at _FLOOR)."""
    import torch

    lse = logits.logsumexp(-1, keepdim=True)
    head = logits.gather(-1, top) - lse
    tail = logits.scatter(-1, top, float("-inf")).logsumexp(-1, keepdim=True) - lse
    return torch.cat([head, tail], -1).clamp(min=_FLOOR)


def teacher_targets(model, ids, top_k: int = TOP_K, batch: int = 8):
    """(top [S, T, k] int64, log_probs [S, T, k + 1] float32): the float `model`'s coarsened
    next-token distributions at every position of `ids [S, T]`."""
    import torch

    tops, logps = [], []
    with torch.no_grad():
        for i in range(0, ids.shape[0], batch):
            logits = model(input_ids=ids[i:i + batch], use_cache=False).logits.float()
            top = logits.topk(min(top_k, logits.shape[-1] - 1), dim=-1).indices
            tops.append(top)
            logps.append(coarse_log_probs(logits, top))
    return torch.cat(tops), torch.cat(logps)


def kl(student_logits, top, teacher_log_probs):
    """Mean over positions of KL(teacher || student) on the coarsened bins."""
    s = coarse_log_probs(student_logits.float(), top)
    t = teacher_log_probs
    return (t.exp() * (t - s)).sum(-1).mean()


def norm_weights(model) -> dict:
    """{name: parameter} of every RMSNorm weight of `model` (each layer's, the final norm's)."""
    return {f"{name}.weight": module.weight for name, module in model.named_modules()
            if type(module).__name__.endswith("RMSNorm") and getattr(module, "weight", None) is not None}


def group_scaled_linear(q, zero, scale, bias=None):
    """The module that stands in for a 4-bit linear during the tuning: weight [N, K] =
    (q - z) * s0 * (1 + d) per group of g input columns, `d [N, K/g]` its one parameter (zero at
    first). q int [N, K], zero int [N, K/g], scale [N, K/g] (awq.quant_params'), bias [N]?"""
    import torch

    class GroupScaledLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            n, k = q.shape
            g = k // zero.shape[1]
            codes = (q.reshape(n, -1, g) - zero[..., None]).to(torch.float32)  # exact small integers
            self.register_buffer("codes", codes, persistent=False)             # [N, K/g, g]
            self.register_buffer("scale0", scale.detach().float().clone(), persistent=False)  # [N, K/g], own copy
            self.d = torch.nn.Parameter(torch.zeros_like(self.scale0))
            self.bias = None if bias is None else bias.detach()

        def scale(self):
            return self.scale0 * (1 + self.d)

        def forward(self, x):
            w = (self.codes * self.scale()[..., None]).reshape(self.codes.shape[0], -1)
            return torch.nn.functional.linear(x, w, self.bias)

    return GroupScaledLinear()


def _mean_kl(model, ids, top, targets, batch: int) -> float:
    import torch

    total = 0.0
    with torch.no_grad():
        for i in range(0, ids.shape[0], batch):
            logits = model(input_ids=ids[i:i + batch], use_cache=False).logits
            total += kl(logits, top[i:i + batch], targets[i:i + batch]).item() * ids[i:i + batch].shape[0]
    return total / ids.shape[0]


def tune(model, codes: dict, scale_dtype, ids, top, targets, steps: int = STEPS, lr: float = LR,
         batch: int = BATCH, log=None):
    """Train the group scales of the linears in `codes` ({module path: (q, zero, scale)} of
    `awq.quant_params`) and `model`'s norm weights (in place) to lower `kl` on `ids [S, T]`
    against the targets of `teacher_targets`. Returns ({module path: scale [N, K/g] in
    scale_dtype}, KL before, KL after); when after >= before every value is put back (the
    scales returned are `codes`' own) and after = before. The linears are `model`'s own modules
    again on return (their weights untouched); nothing else of `model` changes."""
    import torch

    log = log or (lambda text: None)
    norms = norm_weights(model)
    start = {name: p.detach().clone() for name, p in norms.items()}
    originals = {path: model.get_submodule(path) for path in codes}
    stand_ins = {path: group_scaled_linear(*codes[path], bias=originals[path].bias) for path in codes}
    trainable = list(norms.values()) + [m.d for m in stand_ins.values()]
    was_trainable = [p for p in model.parameters() if p.requires_grad]
    for p in was_trainable:
        p.requires_grad_(False)

    def install(modules):
        for path, module in modules.items():
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent), leaf, module)

    install(stand_ins)
    try:
        before = _mean_kl(model, ids, top, targets, batch)
        for p in trainable:
            p.requires_grad_(True)
        optimizer = torch.optim.Adam(trainable, lr=lr)
        gen = torch.Generator().manual_seed(0)
        order = torch.empty(0, dtype=torch.long)
        for step in range(1, steps + 1):
            if order.numel() == 0:
                order = torch.randperm(ids.shape[0], generator=gen)
            pick, order = order[:batch], order[batch:]
            optimizer.zero_grad(set_to_none=True)
            loss = kl(model(input_ids=ids[pick], use_cache=False).logits, top[pick], targets[pick])
            loss.backward()
            optimizer.step()
            log(f"quantize: tuning step {step}/{steps}: KL {loss.item():.4f} (batch of {len(pick)})")
        with torch.no_grad():
            for m in stand_ins.values():  # what the checkpoint will hold
                m.scale0.copy_(m.scale().to(scale_dtype).float())
                m.d.zero_()
        after = _mean_kl(model, ids, top, targets, batch)
        if not after < before:
            with torch.no_grad():
                for name, p in norms.items():
                    p.copy_(start[name])
            return {path: codes[path][2].to(scale_dtype) for path in codes}, before, before
        return {path: m.scale0.to(scale_dtype) for path, m in stand_ins.items()}, before, after
    finally:
        install(originals)
        for p in trainable:
            p.requires_grad_(False)
            p.grad = None
        for p in was_trainable:
            p.requires_grad_(True)
