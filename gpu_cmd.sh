python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
mkdir -p /tmp/arts && cd benchmarks && python3 - > $OUT/compile.log 2>&1 <<'PY'
from pathlib import Path
from memory_footprint import compile_artifact
for name, batch in [("resnet50", 8), ("inception_v3", 8), ("inception_v3", 1), ("googlenet", 1)]:
    print(compile_artifact(name, batch, Path("/tmp/arts")))
PY
timeout 200 python3 fold_speed.py /tmp/arts/*.nimble > $OUT/fold_speed.txt 2>&1
cd .. && timeout 120 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_runtime.py -k footprint 2>&1 | tail -1 >> $OUT/fold_speed.txt
