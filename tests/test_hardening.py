"""What a user relies on beyond equal tokens: nothing silently lost (save_pretrained, state_dict, enable of an
edited model), safe under threads, recoverable after a failed read or a failed disable, clear refusals (dtype and
device changes, backward, experts_implementation), and the ecosystem's logging and progress switches."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading

import pytest
import torch
import transformers

import hf_moe_offload
import hf_moe_offload.storage.store as store_module
from conftest import VOCAB, model_class, offloaded, reference

DISK = {"device": "cpu", "store": "disk", "expert_cache": "34%"}


def _ids(batch: int = 2, length: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, tokens: int = 8) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)


def _in_threads(work, count: int) -> list[BaseException]:
    """Run `work(i)` for i in range(count), each in its own thread, at once; the errors they raised."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


# -- nothing silently lost ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("family", ["mixtral", "switch_transformers"])
def test_save_pretrained_writes_every_expert_and_reloads_to_the_same_tokens(tiny_models, tmp_path, family, store):
    budget = "50%" if store == "disk" else "100%"     # experts in host memory are used in place on the CPU
    model = offloaded(family, tiny_models[family], device="cpu", store=store, expert_cache=budget)
    ref = reference(family, tiny_models[family])
    assert model.state_dict().keys() == ref.state_dict().keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.state_dict().items())

    model.save_pretrained(tmp_path / "saved")
    reloaded = model_class(family).from_pretrained(tmp_path / "saved").eval()
    ids = _ids()
    assert torch.equal(_generate(reloaded, ids), _generate(ref, ids))
    assert torch.equal(_generate(model, ids), _generate(ref, ids))   # saving changed nothing


def test_enable_with_a_disk_store_keeps_in_memory_edits(tiny_models):
    model = reference("mixtral", tiny_models["mixtral"])
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.down_proj.normal_(std=1.0, generator=torch.Generator().manual_seed(5))   # an edit
    ids = _ids()
    edited = _generate(model, ids)
    assert not torch.equal(edited, _generate(reference("mixtral", tiny_models["mixtral"]), ids))

    hf_moe_offload.enable(model, DISK)
    folder = os.path.dirname(hf_moe_offload.get_engine(model).store.files[0])
    assert torch.equal(_generate(model, ids), edited)
    hf_moe_offload.disable(model)
    assert torch.equal(_generate(model, ids), edited)
    assert not os.path.exists(folder)                     # the temporary offload folder went with the engine


# -- threads ----------------------------------------------------------------------------------------------------

def test_concurrent_generate_gives_each_caller_its_own_tokens(tiny_models):
    model = offloaded("mixtral", tiny_models["mixtral"], **DISK)
    prompts = [_ids(batch=1 + i % 2, seed=i) for i in range(4)]
    expected = [_generate(model, p, tokens=10) for p in prompts]
    results: dict[int, torch.Tensor] = {}

    def run(i: int) -> None:
        for _ in range(3):
            results[i] = _generate(model, prompts[i], tokens=10)
            assert torch.equal(results[i], expected[i])

    errors = _in_threads(run, 4)
    assert not errors, errors
    assert all(torch.equal(results[i], expected[i]) for i in range(4))


def test_concurrent_loads_leave_transformers_unpatched(tiny_models):
    import transformers.core_model_loading as core_model_loading
    import transformers.modeling_utils as modeling_utils

    from transformers import PreTrainedModel

    originals = (modeling_utils.accelerate_dispatch, core_model_loading._materialize_copy, modeling_utils.safe_open,
                 PreTrainedModel.tie_weights, PreTrainedModel.init_weights)   # the last two transformers swaps itself
    models = []

    def load(i: int) -> None:
        if i % 3 == 2:   # an ordinary load beside the offloaded ones
            models.append(reference("mixtral", tiny_models["mixtral"]))
        else:
            models.append(offloaded("mixtral", tiny_models["mixtral"], **DISK))

    errors = _in_threads(load, 6)
    assert not errors, errors
    assert (modeling_utils.accelerate_dispatch, core_model_loading._materialize_copy, modeling_utils.safe_open,
            PreTrainedModel.tie_weights, PreTrainedModel.init_weights) == originals
    ids = _ids()
    expected = _generate(reference("mixtral", tiny_models["mixtral"]), ids)
    assert all(torch.equal(_generate(m, ids), expected) for m in models)


# -- failures leave a usable model ------------------------------------------------------------------------------

def _copy_model(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_a_failed_expert_read_does_not_poison_the_cache(tiny_models, monkeypatch):
    path = tiny_models["mixtral"]
    model = offloaded("mixtral", path, **DISK)
    ids = _ids()

    def unreadable(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error (injected)")

    with monkeypatch.context() as failing:      # every expert read fails, as on a failing disk
        failing.setattr(store_module, "pread_exact", unreadable)
        failing.setattr(store_module, "read_into", unreadable)
        with pytest.raises(OSError, match="injected"):
            _generate(model, ids)
    expected = _generate(reference("mixtral", path), ids)
    assert torch.equal(_generate(model, ids), expected)
    assert torch.equal(_generate(model, ids), expected)


def test_a_failed_disable_leaves_the_model_offloaded_and_working(tiny_models, tmp_path):
    path = _copy_model(tiny_models["mixtral"], tmp_path / "m")
    model = offloaded("mixtral", path, **DISK)
    ids = _ids()
    expected = _generate(reference("mixtral", path), ids)
    last = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[-1]
    with open(os.path.join(path, last), "r+b") as f:     # truncate a shard the experts of a later layer live in
        f.truncate(os.path.getsize(os.path.join(path, last)) // 2)
    with pytest.raises(Exception):
        hf_moe_offload.disable(model)
    assert hf_moe_offload.get_engine(model) is not None
    # The same bytes, size and modification time again: the file is the one that was indexed (a changed one would
    # be refused, naming it).
    shutil.copy2(os.path.join(tiny_models["mixtral"], last), os.path.join(path, last))
    assert torch.equal(_generate(model, ids), expected)
    hf_moe_offload.disable(model)
    assert torch.equal(_generate(model, ids), expected)


@pytest.mark.parametrize("how", ["from_pretrained", "enable"])
def test_a_model_offloaded_under_inference_mode_generates_outside_it(tiny_models, how):
    """Slots and buffers allocated under inference mode could not be copied into outside it (F2)."""
    with torch.inference_mode():
        if how == "from_pretrained":
            model = offloaded("mixtral", tiny_models["mixtral"], **DISK)
        else:
            model = hf_moe_offload.enable(reference("mixtral", tiny_models["mixtral"]), DISK)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(_generate(model, ids), _generate(reference("mixtral", tiny_models["mixtral"]), ids))


# -- clear refusals -------------------------------------------------------------------------------------------------

def test_dtype_and_device_changes_are_refused_and_the_model_keeps_working(tiny_models):
    model = offloaded("mixtral", tiny_models["mixtral"], **DISK)
    ids = _ids()
    before = _generate(model, ids)
    with pytest.raises(hf_moe_offload.PolicyError, match="disable"):
        model.half()
    with pytest.raises(hf_moe_offload.PolicyError, match="disable"):
        model.to(torch.bfloat16)
    assert model.to("cpu") is model                       # no change: allowed
    assert next(model.parameters()).dtype == torch.float32
    assert torch.equal(_generate(model, ids), before)


def test_backward_through_offloaded_experts_is_refused_but_inference_with_grad_works(tiny_models):
    model = offloaded("mixtral", tiny_models["mixtral"], **DISK).train()
    ids = _ids()
    logits = model(ids).logits                            # grad mode on, as in many user scripts
    with torch.no_grad():
        torch.testing.assert_close(logits, reference("mixtral", tiny_models["mixtral"])(ids).logits,
                                   rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="backward through hf_moe_offload"):
        logits.sum().backward()


@pytest.mark.parametrize("policy", [DISK, {"device": "cpu", "store": "cpu"}])
def test_training_only_the_routers_is_refused_not_given_wrong_gradients(tiny_models, policy):
    """The experts' outputs are scaled by the routing weights without autograd: a trainable router would get only
    its auxiliary loss's share of the gradient, so its backward is refused as one through the experts' input is."""
    model = offloaded("mixtral", tiny_models["mixtral"], **policy)
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith("mlp.gate.weight"))
    ids = _ids()
    with pytest.raises(RuntimeError, match="backward through hf_moe_offload"):
        model(ids, labels=ids, output_router_logits=True).loss.backward()


@pytest.mark.parametrize("policy", [DISK, {"device": "cpu", "store": "cpu"}])
def test_load_state_dict_with_expert_weights_is_refused_before_anything_loads(tiny_models, policy):
    """The experts are read from the store: new expert weights would be dropped (strict=False) or fail deep in
    torch (strict=True). Refused naming a key, with nothing loaded; weights without experts still load."""
    model = offloaded("mixtral", tiny_models["mixtral"], **policy)
    ids = _ids()
    before = model(ids).logits
    changed = {k: v + 1 for k, v in model.state_dict().items()}
    for strict in (True, False):
        with pytest.raises(hf_moe_offload.PolicyError, match=r"'model\.layers\.0\.mlp\.experts\..*disable"):
            model.load_state_dict(changed, strict=strict)
    assert torch.equal(model(ids).logits, before)               # not even the embeddings were loaded
    head = {"lm_head.weight": changed["lm_head.weight"]}
    assert model.load_state_dict(head, strict=False).unexpected_keys == []
    assert torch.equal(model.lm_head.weight, head["lm_head.weight"])


@pytest.mark.parametrize("policy", [DISK, {**DISK, "expert_cache": "50%", "micro_batches": 2, "prefetch": "auto"}])
def test_deepcopy_and_pickle_of_an_offloaded_model_are_refused_and_work_after_disable(tiny_models, policy):
    """A copy would share one store, cache and reader threads with the original (deepcopy failed on a lock, pickle
    on a local function): refused with what to do. After disable() both work, and the copy has the model's own
    routers (no cached routing rebuilt from the original's modules)."""
    import copy
    import pickle
    model = offloaded("mixtral", tiny_models["mixtral"], **policy)
    ids = _ids()
    _generate(model, ids)                                   # the look-ahead probes (and caches) the routers' kind
    for copier in (copy.deepcopy, pickle.dumps):
        with pytest.raises(hf_moe_offload.PolicyError, match="cannot be copied or pickled.*disable"):
            copier(model)
    hf_moe_offload.disable(model)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(_generate(clone, ids), _generate(model, ids))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_generate_does_not_auto_compile_offloaded_models_and_saves_the_users_generation_config(tiny_models,
                                                                                                tmp_path):
    """Auto-compiling is off for the offloaded model instance, not written into its generation config: a
    checkpoint saved from it does not turn compiling off for whoever loads it later."""
    model = reference("mixtral", tiny_models["mixtral"])
    before = model.generation_config.to_dict()
    hf_moe_offload.enable(model, DISK)
    assert not model._valid_auto_compile_criteria({}, model.generation_config)
    assert model.generation_config.to_dict() == before
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text()).get("disable_compile", False) is False
    hf_moe_offload.disable(model)
    assert "_valid_auto_compile_criteria" not in vars(model)


def test_experts_implementation_next_to_a_policy_is_not_replaced_silently(tiny_models):
    records = _Records()
    logging.getLogger("hf_moe_offload").addHandler(records)
    try:
        model = model_class("mixtral").from_pretrained(tiny_models["mixtral"], offload_policy=DISK,
                                                       experts_implementation="eager")
    finally:
        logging.getLogger("hf_moe_offload").removeHandler(records)
    assert any("experts_implementation='eager' is not used" in m for m in records.messages)
    ids = _ids()
    assert torch.equal(_generate(model, ids), _generate(reference("mixtral", tiny_models["mixtral"]), ids))


# -- observers ------------------------------------------------------------------------------------------------------

def test_a_layer_hook_sees_every_routing_decision_and_can_be_removed(tiny_models):
    model = offloaded("mixtral", tiny_models["mixtral"], **DISK)

    class Recorder(hf_moe_offload.LayerHook):
        def __init__(self):
            self.routed, self.done = [], []

        def on_route(self, layer, experts):
            self.routed.append((layer, list(experts)))

        def on_layer_done(self, layer):
            self.done.append(layer)

    recorder = Recorder()
    handle = hf_moe_offload.get_engine(model).add_hook(recorder)
    hf_moe_offload.stats(model).reset()
    with torch.no_grad():
        model(_ids())
    snap = hf_moe_offload.stats(model)
    assert [layer for layer, _ in recorder.routed] == recorder.done == [0, 1]
    assert sum(len(e) for _, e in recorder.routed) == snap["experts_used"] == snap["hits"] + snap["misses"]
    for layer, experts in recorder.routed:          # which experts each layer call touched, per expert
        calls = snap["per_layer"][layer]["expert_calls"]
        assert sorted(e for e, n in enumerate(calls) for _ in range(n)) == sorted(experts)
    handle.remove()
    with torch.no_grad():
        model(_ids())
    assert len(recorder.routed) == 2


# -- ecosystem switches ---------------------------------------------------------------------------------------------

def test_log_lines_follow_transformers_verbosity():
    ours = logging.getLogger("hf_moe_offload.runtime.engine")
    package = logging.getLogger("hf_moe_offload")
    before, package_level = transformers.logging.get_verbosity(), package.level
    package.setLevel(logging.NOTSET)     # unset, as in a user's script (the CLI sets INFO on it)
    try:
        transformers.logging.set_verbosity_info()
        assert ours.isEnabledFor(logging.INFO)
        transformers.logging.set_verbosity_error()
        assert not ours.isEnabledFor(logging.WARNING)
    finally:
        transformers.logging.set_verbosity(before)
        package.setLevel(package_level)


def test_progress_bars_follow_transformers_switch(tiny_models, capsys):
    transformers.logging.disable_progress_bar()
    try:
        offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="cpu")
    finally:
        transformers.logging.enable_progress_bar()
    err = capsys.readouterr().err
    assert "Loading experts" not in err and "it/s" not in err


def test_a_checkpoint_whose_config_names_no_dtype_loads(tmp_path):
    """transformers then reads the dtype from the first shard (safe_open without a backend): the load patches must
    pass such calls through unchanged."""
    import json

    from conftest import build_tiny

    path = build_tiny("mixtral", tmp_path / "nodtype", dtype=torch.bfloat16)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    with open(config_file, "w") as f:
        json.dump(config, f)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    expected = reference("mixtral", path).generate(ids, max_new_tokens=4, do_sample=False)
    model = offloaded("mixtral", path, device="cpu", store="disk", expert_cache="34%")
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)
