"""``python -m minipaged.gpu_check``: kept so the documented command still works.

The check itself is minipaged/tools/gpu_check.py (``python -m minipaged.tools.gpu_check``).
"""

from .tools.gpu_check import main

if __name__ == "__main__":
    raise SystemExit(main())
