"""A deliberately wrong vendor for the conformance tests: the torch vendor's ops, except that
rms_norm's output is off by 3%. With WRONG_VENDOR_DECLARES=1 it declares a tolerance that hides
the error and a skip, as a vendor package would for its hardware."""

import os

from dlinfer.vendor import Capabilities, Vendor


def load() -> Vendor:
    from dlinfer.vendor import registry

    base = registry.load("torch")
    good = base.ops["rms_norm"]

    def rms_norm(hidden_states, weight, epsilon):
        return good(hidden_states, weight, epsilon) * 1.03

    declares = os.environ.get("WRONG_VENDOR_DECLARES") == "1"
    caps = Capabilities(
        features=base.capabilities.features,
        conformance_tolerances={"rms_norm": (0.05, 0.05)} if declares else {},
        conformance_skips={"silu_and_mul[*bfloat16*]": "our bf16 silu is approximate"} if declares else {},
    )
    return Vendor(name="wrong", device_types=("cpu",), kv_layouts=base.kv_layouts,
                  ops={**base.ops, "rms_norm": rms_norm}, capabilities=caps)
