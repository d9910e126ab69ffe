"""benchmarks/variant_log.py: the stall bench's log of the Triton variants each process builds, and how a call's
variant differs from the closest one another process built (the grid's children)."""

import json
import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import variant_log  # noqa: E402

_ARGS = ["q_ptr", "Lq", "n_states", "BLOCK_M"]


def _entry(pid, spec, options="{'num_warps': 4}", name="_suffix_fwd_kernel"):
    return {"pid": pid, "name": name, "arg_names": _ARGS, "key": f"[{', '.join(spec)}]{options}", "s": 1.0, "t": 0.0}


def test_the_difference_names_the_arguments_specialised_otherwise():
    grid = [_entry(2, ["('*bf16', 'D')", "('i32', '')", "('i32', '')", "('constexpr', 32)"]),
            _entry(2, ["('*bf16', 'D')", "('i32', '')", "('constexpr', 1)", "('constexpr', 64)"]),
            _entry(2, ["('*bf16', 'D')"], name="_prefix_fwd_kernel")]
    call = _entry(1, ["('*bf16', 'D')", "('i32', '')", "('constexpr', 1)", "('constexpr', 32)"])
    diff = variant_log.closest_difference(call, grid)
    assert set(diff) in ({"n_states"}, {"BLOCK_M"})  # one argument apart from either of the grid's variants
    assert variant_log.difference(call, grid[0]) == {"n_states": ["('i32', '')", "('constexpr', 1)"]}
    assert variant_log.closest_difference(_entry(1, [], name="_cascade_fwd_kernel"), grid) is None
    other_options = _entry(1, ["('*bf16', 'D')", "('i32', '')", "('i32', '')", "('constexpr', 32)"],
                           options="{'num_warps': 8}")
    assert set(variant_log.difference(other_options, grid[0])) == {"options"}
    same = dict(grid[0], pid=1, disk_hash="b" * 8, cache_dir="/tmp/a")  # equal keys, but another file on disk
    assert variant_log.difference(same, dict(grid[0], disk_hash="a" * 8, cache_dir="/tmp/a")) == {
        "disk_hash": ["a" * 8, "b" * 8]}
    assert variant_log.difference(same, grid[0]) == {}  # (an entry without them: nothing to compare)
    libs = dict(same, metadata={"extern_libs": "libdevice A", "debug": "False"})
    assert variant_log.difference(libs, dict(libs, metadata={"extern_libs": "libdevice B", "debug": "False"})) == {
        "metadata.extern_libs": ["libdevice B", "libdevice A"]}


def test_install_logs_each_variant_the_process_builds(tmp_path, monkeypatch):
    from triton.runtime.jit import JITFunction

    built = []
    monkeypatch.setattr(JITFunction, "_do_compile", lambda self, key, *a, **k: built.append(key) or "kernel")
    path = str(tmp_path / "variants.jsonl")
    assert variant_log.install(path)
    fake = types.SimpleNamespace(__name__="_suffix_fwd_kernel", arg_names=_ARGS)
    assert JITFunction._do_compile(fake, "[('constexpr', 16)]{}", None, None, None, None, None, False) == "kernel"
    entries = variant_log.read(path)
    assert built == ["[('constexpr', 16)]{}"] and len(entries) == 1
    assert entries[0]["name"] == "_suffix_fwd_kernel" and entries[0]["pid"] == os.getpid()
    assert json.loads(json.dumps(entries[0]))["arg_names"] == _ARGS
    monkeypatch.delenv(variant_log.ENV, raising=False)
    assert not variant_log.install("")  # no path, no hook


def test_the_reader_takes_complete_lines_only(tmp_path):
    path = tmp_path / "variants.jsonl"
    reader = variant_log.LogReader(str(path))
    assert reader.new_entries() == []
    first = json.dumps(_entry(1, ["('i32', '')"]))
    path.write_text(first + "\n" + first[:10])  # a second line still being written
    assert len(reader.new_entries()) == 1
    with open(path, "a") as f:
        f.write(first[10:] + "\n")
    assert len(reader.new_entries()) == 1 and len(reader.entries) == 2


def test_the_nearest_two_and_where_each_was_launched_from():
    grid = [dict(_entry(2, ["('*bf16', 'D')", "('i32', '')", "('i32', '')", "('constexpr', 32)"]),
                 launched_from=["prefill.py:186 prefill_levels"]),
            dict(_entry(2, ["('*i64', 'D')", "('i32', '')", "('constexpr', 1)", "('constexpr', 64)"]),
                 launched_from=["cache.py:577 CascadeCache.attend"])]
    call = dict(_entry(1, ["('*bf16', 'D')", "('i32', '')", "('constexpr', 1)", "('constexpr', 32)"]),
                launched_from=["cache.py:577 CascadeCache.attend"])
    first, second = variant_log.nearest_differences(call, grid, 2)
    assert set(first) == {"n_states", "launched_from"}
    assert first["launched_from"] == [["prefill.py:186 prefill_levels"], ["cache.py:577 CascadeCache.attend"]]
    assert set(second) == {"q_ptr", "BLOCK_M", "launched_from"}
    assert variant_log.nearest_differences(call, [], 2) == []
