"""dlinfer.vendor.ascend from dlinfer-vendor-ascend-example: a LAYOUT DEMONSTRATION with stand-in
content, not an Ascend implementation. CALLS counts the stand-ins LMDeploy reached."""

from collections import Counter

CALLS: Counter = Counter()
