"""tools/ray_carry.py, without downloading anything: which wheels it carries (what the device
image lacks) and what it prunes from the site folder."""

import importlib.util

from .conftest import ROOT


def _module():
    spec = importlib.util.spec_from_file_location("ray_carry", ROOT / "tools" / "ray_carry.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_wheels_the_device_lacks_are_carried(tmp_path):
    m = _module()
    names = ["ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl", "numpy-2.1.0-cp312-cp312-manylinux_2_17_x86_64.whl",
             "pydantic_core-2.33.2-cp312-cp312-manylinux_2_17_x86_64.whl", "PyYAML-6.0-cp312-cp312-x.whl",
             "typing_extensions-4.12.0-py3-none-any.whl"]
    wheels = [tmp_path / n for n in names]
    assert [w.name for w in m.to_carry(wheels)] == [names[0], names[2]]
    assert m.project_of(wheels[2]) == "pydantic-core" and m.project_of(wheels[3]) == "pyyaml"


def test_prune_removes_what_serving_never_imports(tmp_path):
    m = _module()
    for rel in ("ray/rllib/a.py", "ray/jars/ray_dist.jar", "ray/serve/api.py", "ray/serve/tests/t.py",
                "ray/dashboard/client/build/main.js", "ray/dashboard/agent.py", "starlette/tests/x.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x" * 10)
    assert m.prune(tmp_path) == 50
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.*"))
    assert left == ["ray/dashboard/agent.py", "ray/serve/api.py"]
