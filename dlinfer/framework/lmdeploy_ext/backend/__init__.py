"""LMDeploy ops backends of dlinfer's device types (see `op_backend.py`)."""
