"""Sets the GIL switch interval of every Python process started with this folder on PYTHONPATH (PDSERVE_EXP_SWITCH)."""

import os
import sys

_v = os.environ.get("PDSERVE_EXP_SWITCH")
if _v:
    sys.setswitchinterval(float(_v))
