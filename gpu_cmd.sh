python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu_runtime.py -k "footprint or budget or trace or bench or parity" 2>&1 | tail -15 > $OUT/gpu_tests.log
cd benchmarks && timeout 330 python3 memory_footprint.py --no-peer --out $OUT --batches 1 8 > $OUT/footprint_log.txt 2>&1
echo "bench rc=$?" >> $OUT/footprint_log.txt
