python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
mkdir -p $OUT/r
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider > $OUT/r/gpu_tests.txt 2>&1; echo "exit $?" >> $OUT/r/gpu_tests.txt
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/cli tests/passes tests/runtime/test_compare.py --deselect "tests/cli/test_user_side.py::test_a_signal_ends_the_command_in_one_line_with_nothing_left" > $OUT/r/cli_tests.txt 2>&1; echo "exit $?" >> $OUT/r/cli_tests.txt
tail -2 $OUT/r/gpu_tests.txt; tail -4 $OUT/r/cli_tests.txt
