"""Level 1 of the hook: NCCL groups get ``"<group_desc>:<group_name>"`` as their commName.

No PyTorch at hand has ``NCCLConfig.comm_name`` yet, so these tests drive the hook's wrapper with a
``distributed_c10d`` shaped like one that has it: the same helper signature and options objects."""

from __future__ import annotations

import types

from comminsight_inject import hook


class _Config:
    comm_name = ""  # a property of the class in PyTorch's binding, as naming_level looks for it


class _Options:
    def __init__(self) -> None:
        self.config = _Config()
        self.is_high_priority_stream = True
        self._timeout = None


def _c10d_with_comm_name():
    created: list[dict] = []

    def _new_process_group_helper(
        group_size,
        group_rank,
        global_ranks_in_group,
        backend,
        store,
        group_name,
        backend_options=None,
        timeout=None,
        pg_tag=None,
        device_id=None,
        group_desc=None,
    ):
        created.append({"backend": backend, "name": group_name, "options": backend_options})
        return object()

    nccl = types.SimpleNamespace(Options=_Options, NCCLConfig=_Config)
    c10d = types.SimpleNamespace(ProcessGroupNCCL=nccl, _new_process_group_helper=_new_process_group_helper)
    return c10d, created


def test_an_unnamed_nccl_group_gets_its_description_and_name_as_comm_name():
    c10d, created = _c10d_with_comm_name()
    wrapped = hook._name_communicators(c10d._new_process_group_helper, c10d)
    wrapped(2, 0, [0, 1], "nccl", None, "7", group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    assert created[0]["options"].config.comm_name == "TENSOR_MODEL_PARALLEL_GROUP:7"
    assert created[0]["options"].is_high_priority_stream is False


def test_an_explicit_comm_name_wins_and_a_reused_options_object_is_not_changed():
    c10d, created = _c10d_with_comm_name()
    wrapped = hook._name_communicators(c10d._new_process_group_helper, c10d)
    named = _Options()
    named.config.comm_name = "mine"
    shared = _Options()
    wrapped(2, 0, [0, 1], "nccl", None, "3", backend_options=named, group_desc="DATA_PARALLEL_GROUP")
    wrapped(2, 0, [0, 1], "nccl", None, "4", backend_options=shared, group_desc="DATA_PARALLEL_GROUP")
    wrapped(2, 0, [0, 1], "nccl", None, "5", backend_options=shared)
    assert created[0]["options"].config.comm_name == "mine"
    assert [c["options"].config.comm_name for c in created[1:]] == ["DATA_PARALLEL_GROUP:4", "undefined:5"]
    assert shared.config.comm_name == ""


def test_gloo_groups_and_a_failing_name_never_stop_group_creation():
    c10d, created = _c10d_with_comm_name()
    wrapped = hook._name_communicators(c10d._new_process_group_helper, c10d)
    wrapped(2, 0, [0, 1], "gloo", None, "1", group_desc="default_pg")
    assert created[0]["options"] is None
    del c10d.ProcessGroupNCCL.Options  # a PyTorch change under the hook: the group is still created
    wrapped(2, 0, [0, 1], "nccl", None, "2")
    assert len(created) == 2


def test_a_pytorch_whose_nccl_config_has_comm_name_is_level_one():
    c10d, _ = _c10d_with_comm_name()
    c10d._world = object()
    for name in hook._RECORD_AFTER[:2]:
        setattr(c10d, name, lambda *a, **k: None)
    assert hook.naming_level(c10d)[0] == 1
