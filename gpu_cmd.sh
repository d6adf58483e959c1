python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu 2>&1 | grep -E "^E  |passed|failed" | head -20 > $OUT/gpu_tests.log
cd benchmarks && timeout 300 python3 memory_footprint.py --no-peer --models resnet50 inception_v3 googlenet densenet121 nasnet resnet --batches 1 8 --out $OUT > $OUT/footprint_log.txt 2>&1
