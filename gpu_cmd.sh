python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_runtime.py 2>&1 | tail -12 > $OUT/gpu_tests.log
mkdir -p /tmp/arts && cd benchmarks && python3 - > $OUT/compile.log 2>&1 <<'PY'
from pathlib import Path
from memory_footprint import compile_artifact
for name, batch in [("inception_v3", 1), ("googlenet", 1), ("resnet50", 8), ("nasnet", 1), ("inception", 8)]:
    print(compile_artifact(name, batch, Path("/tmp/arts")))
PY
timeout 120 python3 fold_speed.py /tmp/arts/*.nimble > $OUT/fold_speed.txt 2>&1
timeout 280 python3 memory_footprint.py --no-peer --out $OUT > $OUT/footprint_log.txt 2>&1
echo "rc=$?" >> $OUT/footprint_log.txt
