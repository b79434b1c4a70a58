"""Profiles load, include and validate; every bad input is one InputError naming file and key."""

import pytest

from gpu_tune.errors import InputError
from gpu_tune.tune.policy import list_profile_names, load_all, load_profile


def test_shipped_profiles_load_and_differ():
    names = list_profile_names()
    assert names == ["inference", "training"]
    tr, inf = load_profile("training"), load_profile("inference")
    assert tr.thp.enabled == "always" and tr.thp.defrag == "always"
    assert inf.thp.enabled == "never" and inf.thp.defrag == "never"
    assert tr.sysctl["vm.swappiness"] == 0 and inf.sysctl["vm.swappiness"] == 1
    # shared through include: _base.yaml
    assert tr.cpu.governor == inf.cpu.governor == ["performance", "schedutil"]
    assert tr.gpu.persistence_mode is True
    assert "background_thread:true" in tr.allocator.malloc_conf
    assert all(p.summary for p in load_all())


def test_profiles_explain_their_choices():
    from gpu_tune.tune.policy import default_policy_dir

    for name in ("training.yaml", "inference.yaml", "_base.yaml"):
        text = (default_policy_dir() / name).read_text()
        comments = [ln for ln in text.splitlines() if ln.strip().startswith("#")]
        assert len(comments) >= 5, name


def _write(d, name, text):
    (d / name).write_text(text)


@pytest.mark.parametrize("body,needle", [
    ("name: p\nsysctl:\n  vm.swappiness: 300\n", "sysctl: vm.swappiness: 300 is out of range 0..200"),
    ("name: p\nthp:\n  enabled: sometimes\n", "thp.enabled: 'sometimes' is not allowed"),
    ("name: p\nbogus: 1\n", "bogus: unknown key"),
    ("name: p\nthp:\n  enabld: always\n", "thp.enabld: unknown key"),
    ("name: p\nsysctl: [1, 2\n", "malformed YAML"),
    ("- just\n- a list\n", "a policy must be a mapping"),
    ("name: p\ncpu:\n  governor: turbo\n", "cpu.governor"),
    ("name: p\nirq:\n  exclude_cpus: 'x-y'\n", "not a CPU list"),
    ("name: p\nallocator:\n  malloc_conf: 'not valid'\n", "not a MALLOC_CONF string"),
    ("name: q\n", "does not match the file name"),
    ("name: p\nprobe:\n  accuracy_min: 1.5\n", "probe.accuracy_min"),
    ("name: p\nprobe:\n  train_seconds: 3\n", "probe: train_seconds was replaced: the probe now trains a fixed amount of work"),
    ("name: p\nprobe:\n  train_steps: 0\n", "probe.train_steps: Input should be greater than or equal to 1"),
    ("name: p\nprobe:\n  device_batch_size: 0\n", "probe.device_batch_size"),
    ("name: p\nprobe:\n  window_seconds: -1\n", "probe.window_seconds"),
])
def test_bad_profiles_name_file_and_key(tmp_path, body, needle):
    _write(tmp_path, "p.yaml", body)
    with pytest.raises(InputError) as ei:
        load_profile("p", tmp_path)
    msg = str(ei.value)
    assert str(tmp_path / "p.yaml") in msg
    assert needle in msg
    assert "\n" not in msg


def test_malformed_yaml_gives_line(tmp_path):
    _write(tmp_path, "p.yaml", "name: p\nsysctl:\n  vm.swappiness: [0\n")
    with pytest.raises(InputError, match=r"p\.yaml:\d+:\d+: malformed YAML"):
        load_profile("p", tmp_path)


def test_include_cycle(tmp_path):
    _write(tmp_path, "a.yaml", "include: _b.yaml\nname: a\n")
    _write(tmp_path, "_b.yaml", "include: _c.yaml\n")
    _write(tmp_path, "_c.yaml", "include: _b.yaml\n")
    with pytest.raises(InputError, match="include cycle: a.yaml -> _b.yaml -> _c.yaml -> _b.yaml"):
        load_profile("a", tmp_path)


def test_include_merges_and_overrides(tmp_path):
    _write(tmp_path, "_base.yaml", "sysctl:\n  vm.swappiness: 10\n  vm.dirty_ratio: 30\nthp:\n  enabled: madvise\n")
    _write(tmp_path, "x.yaml", "include: [_base.yaml]\nname: x\nsysctl:\n  vm.swappiness: 0\n")
    p = load_profile("x", tmp_path)
    assert p.sysctl == {"vm.swappiness": 0, "vm.dirty_ratio": 30}
    assert p.thp.enabled == "madvise"


def test_include_missing_and_escaping(tmp_path):
    _write(tmp_path, "x.yaml", "include: _nope.yaml\nname: x\n")
    with pytest.raises(InputError, match="no such policy file"):
        load_profile("x", tmp_path)
    _write(tmp_path, "y.yaml", "include: ../etc/passwd.yaml\nname: y\n")
    with pytest.raises(InputError, match="must be a .yaml file name"):
        load_profile("y", tmp_path)


@pytest.mark.parametrize("name", ["../training", "a/b", "..", "Training", "_base", "baselines", "nope"])
def test_bad_and_unknown_names(name):
    with pytest.raises(InputError):
        load_profile(name)


def test_unknown_profile_lists_known():
    with pytest.raises(InputError, match=r"unknown profile 'nope' .*known: inference, training"):
        load_profile("nope")


def test_unknown_sysctl_key_allowed_but_shape_checked(tmp_path):
    _write(tmp_path, "p.yaml", "name: p\nsysctl:\n  net.core.somaxconn: 4096\n")
    assert load_profile("p", tmp_path).sysctl["net.core.somaxconn"] == 4096
    _write(tmp_path, "p.yaml", "name: p\nsysctl:\n  'vm/../../etc': 1\n")
    with pytest.raises(InputError, match="is not a sysctl key"):
        load_profile("p", tmp_path)


def test_probe_defaults_are_fixed_work():
    p = load_profile("training").probe
    assert (p.train_steps, p.train_batch_size, p.batch_size, p.seed) == (80, 64, 256, 0)
    assert p.device_batch_size is None and p.window_seconds is None


def test_a_profile_of_its_own_folder_includes_a_shipped_one(tmp_path, monkeypatch):
    """A node's own profile, in a folder of its own (--policy-dir), includes the shipped
    training.yaml (found among the shipped profiles when its folder has none), keeps its own name
    and changes only what it says."""
    from gpu_tune.tune.policy import load_profile, shipped_policy_dir

    monkeypatch.setenv("GPU_TUNE_POLICY_DIR", str(tmp_path))  # the env var must not hide the shipped ones
    (tmp_path / "laptop.yaml").write_text("include: training.yaml\nsummary: mine\nsysctl:\n  vm.swappiness: 60\n")
    mine, shipped = load_profile("laptop", tmp_path), load_profile("training", shipped_policy_dir())
    assert mine.name == "laptop" and mine.summary == "mine" and mine.sysctl["vm.swappiness"] == 60
    assert {k: v for k, v in mine.sysctl.items() if k != "vm.swappiness"} == {
        k: v for k, v in shipped.sysctl.items() if k != "vm.swappiness"}
    assert mine.thp == shipped.thp and mine.allocator == shipped.allocator
    # a file of the same name in the folder wins over the shipped one
    (tmp_path / "training.yaml").write_text("include: _base.yaml\nsysctl:\n  vm.swappiness: 7\n")
    assert load_profile("laptop", tmp_path).sysctl["vm.swappiness"] == 60
    assert load_profile("training", tmp_path).sysctl["vm.swappiness"] == 7
    (tmp_path / "broken.yaml").write_text("include: nowhere.yaml\n")
    with pytest.raises(Exception, match="nowhere.yaml.*no such policy file"):
        load_profile("broken", tmp_path)


def test_every_profile_of_a_folder_parses_a_shared_include_once(tmp_path, monkeypatch):
    """200 profiles that include training.yaml (which includes _base.yaml): listing them parses
    each file once per run (10,000 of them took 45 s, re-parsing both includes each time);
    what each profile gets is still its own merge."""
    import shutil
    from collections import Counter

    from gpu_tune.tune import policy

    pol = tmp_path / "pol"
    shutil.copytree(policy.shipped_policy_dir(), pol)
    for i in range(200):
        (pol / f"p{i:03}.yaml").write_text(f"include: training.yaml\nsummary: profile {i}\n"
                                           f"sysctl: {{vm.swappiness: {i % 100}}}\n")
    parsed: Counter[str] = Counter()
    real = policy._yaml_load

    def counting(path):
        parsed[path.name] += 1
        return real(path)

    monkeypatch.setattr(policy, "_yaml_load", counting)
    profiles = {p.name: p for p in load_all(pol)}
    assert len(profiles) == 202 and max(parsed.values()) == 1, parsed.most_common(3)
    assert profiles["p007"].sysctl["vm.swappiness"] == 7 and profiles["p150"].sysctl["vm.swappiness"] == 50
    assert profiles["p007"].summary == "profile 7" and profiles["training"].sysctl["vm.swappiness"] == 0
    assert profiles["p007"].cpu.governor == profiles["training"].cpu.governor  # from _base.yaml


def test_the_shipped_folder_is_looked_up_only_for_an_include_the_policy_folder_lacks(tmp_path, monkeypatch):
    """Resolving where gpu-tune's own profiles lie costs a realpath: it was done for every include,
    found in the policy folder or not (a third of `gpu-tune profiles` with 10,000 profiles)."""
    import shutil

    from gpu_tune.tune import policy

    shipped = policy.shipped_policy_dir()
    pol, own = tmp_path / "pol", tmp_path / "own"
    shutil.copytree(shipped, pol)
    own.mkdir()
    for i in range(50):
        (pol / f"p{i:02}.yaml").write_text(f"include: training.yaml\nsummary: profile {i}\n")
    (own / "node.yaml").write_text("include: training.yaml\nsummary: this node\n")
    calls = []
    monkeypatch.setattr(policy, "shipped_policy_dir", lambda: calls.append(1) or shipped)
    assert len(load_all(pol)) == 52 and calls == []
    assert load_profile("node", own).summary == "this node" and len(calls) == 2  # training.yaml, _base.yaml
