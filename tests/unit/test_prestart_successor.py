"""When a template starts its warm successor (elastic_ddp.prestart.template._Successor.due), in this
process: the template and its successor run in tests/integration/test_prestart.py."""

from __future__ import annotations

from elastic_ddp.prestart import template


def test_the_successor_starts_after_the_first_fork_when_asked_or_after_a_while_and_only_once(tmp_path, monkeypatch):
    def fresh(asked: list[bool]) -> template._Successor:
        return template._Successor(str(tmp_path / "prestart.sock"), 1, asked)

    monkeypatch.setattr(template, "START_AFTER_S", 3600.0)
    assert not fresh([]).due()  # just started serving: its first workers may be on their way
    assert fresh([True]).due()  # SIGUSR1: the agent of a node joining a running job asks
    forked = fresh([])
    forked.worker_forked()  # the node trains: the next restart should find the rest imported
    assert forked.due()
    monkeypatch.setattr(template, "START_AFTER_S", 0.0)
    assert fresh([]).due()  # nobody asked for a while: the agent waits for its peers
    forked.pid = 12345  # started
    assert not forked.due()


def test_every_preload_imports_and_every_call_runs_here_as_in_the_template():
    # The template ignores a preload that fails (the worker imports what it needs itself), so a module
    # renamed or a torch internal the probes call gone would only slow every warm start, silently.
    import importlib

    for name in (*template.PRELOAD_FIRST, *template.PRELOAD_REST):
        module, _, function = name.partition(":")
        imported = importlib.import_module(module)
        if function:
            getattr(imported, function)()
    from torch._inductor import cpp_builder, cpu_vec_isa

    # What the probes are for: answers a fork of the successor finds made.
    assert cpu_vec_isa.valid_vec_isa_list.cache_info().currsize > 0
    assert cpp_builder.get_compiler_version_info.cache_info().currsize > 0
