#!/usr/bin/env bash
# The load tools the client tests run against the gateway (tests/e2e/test_load_tools.py):
# guidellm (vLLM's) and aiperf (NVIDIA's), in a virtual environment of their own, because their
# pinned dependencies (aiperf: orjson, rich, prometheus-client, pandas, ...; guidellm: click)
# would move detgate's. It lives in the state dir (DETGATE_CLIENTS_VENV, default
# ${DETGATE_STATE_DIR:-~/.cache/detgate}/clients-venv) and is made once; a second run only checks
# the versions. guidellm imports torch: the same torch as scripts/install.sh installs.
set -euo pipefail
GUIDELLM=0.8.1
AIPERF=0.13.0
STATE=${DETGATE_STATE_DIR:-$HOME/.cache/detgate}
VENV=${DETGATE_CLIENTS_VENV:-$STATE/clients-venv}
PY=${PYTHON:-python3}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$GUIDELLM" "$AIPERF" <<'EOF'
import sys
from importlib.metadata import version
sys.exit(0 if (version("guidellm"), version("aiperf")) == tuple(sys.argv[1:]) else 1)
EOF
then
  exit 0
fi
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==${DETGATE_TORCH_VERSION:-2.13.0}"
"$VENV/bin/python" -m pip install -q "guidellm==$GUIDELLM" "aiperf==$AIPERF"
echo "install-clients.sh: guidellm $GUIDELLM and aiperf $AIPERF in $VENV"
