"""What the engines generate and score: the `rollout`, `sglang` and `eval` sections of the run config.

Owns: those sections' field names, defaults, types and own invariants, and the allowed-value tables of rollout
functions, reward-model types, engines, weight transports and router policies: each a `Literal` alias, the field's
type (`hpc_rl.config.typing_rules.coerce_value` refuses any other value, at its file line) and the one table the
modules that use it import (`hpc_rl.rewards.scoring`, `hpc_rl.config.sglang_options`, `vllm_flags`). The loss-mask
renderings are `hpc_rl.data.chat_loss_masks`'s (`MaskRendering`), used here as the field's type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from hpc_rl.config.problems import raise_problems
from hpc_rl.config.typing_rules import literal_problems
from hpc_rl.data.chat_loss_masks import MASK_RENDERINGS, MaskRendering

RmType = Literal["deepscaler", "dapo", "math", "f1", "remote_rm", "tiny_task", "geo3k", "tiny_vl_task"]
RM_TYPES: tuple[str, ...] = get_args(RmType)
EngineKind = Literal["auto", "sglang", "cpu"]
ENGINE_KINDS: tuple[str, ...] = get_args(EngineKind)
WeightTransport = Literal["nccl", "disk"]
RouterPolicy = Literal["cache_aware", "round_robin", "power_of_two", "random"]
SGLANG_ROLLOUT = "slime.rollout.sglang_rollout.generate_rollout"
SFT_ROLLOUT = "slime.rollout.sft_rollout.generate_rollout"
VIME_ROLLOUT = "vime.rollout.vllm_rollout.generate_rollout"
"""vime's (slime on vLLM) default rollout: the same generation as slime's."""
ROLLOUT_FUNCTIONS = (SGLANG_ROLLOUT, VIME_ROLLOUT, SFT_ROLLOUT)
LOSS_MASK_TYPES = MASK_RENDERINGS
ROUTER_POLICIES: tuple[str, ...] = get_args(RouterPolicy)
"""sglang-router 0.3.2's load-balancing policies."""


@dataclass(kw_only=True)
class RolloutConfig:
    """Prompt data, sampling, rewards, dynamic sampling and partial rollout."""

    prompt_data: str = ""
    """Path of the training prompts (.jsonl or .parquet)."""
    input_key: str = "prompt"
    """Field holding the prompt: a string or a list of chat messages."""
    label_key: str | None = "label"
    """Field holding the ground truth for the reward (null: none)."""
    metadata_key: str | None = None
    """Optional field holding a dict copied into each sample's metadata."""
    tool_key: str | None = None
    """Optional field with tool definitions passed to the chat template."""
    apply_chat_template: bool = False
    """Run the tokenizer's chat template (add_generation_prompt) on the prompt."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template, e.g. {enable_thinking: false} (slime's --apply-chat-template-kwargs,
    JSON on the command line)."""
    multimodal_keys: dict[str, str] = field(default_factory=dict)
    """Media kind -> the data column holding each row's items, e.g. {image: images} (slime's --multimodal-keys, JSON
    on the command line). Each `<image>` in the prompt takes the row's next image (a path relative to the data file,
    base64, bytes); needs apply_chat_template and a Qwen-VL checkpoint; every image is checked at submit."""
    max_image_bytes: int = 32 * 1024 * 1024
    """A prompt image larger than this (encoded bytes) is refused at submit, naming its row."""
    max_image_pixels: int = 4096 * 4096
    """A prompt image with more pixels than this (width x height) is refused at submit, naming its row."""
    skip_bad_lines: bool = False
    """Skip malformed data lines (and report their count) instead of failing."""
    rollout_shuffle: bool = False
    """Shuffle the prompts each epoch (seeded by rollout_seed and the epoch)."""
    rollout_seed: int = 42
    """Seed of the data order and of sampling."""
    rm_type: RmType | None = None
    """Built-in reward: deepscaler | dapo | math | f1 | remote_rm | tiny_task | geo3k | tiny_vl_task."""
    custom_rm_path: str | None = None
    """Import path of a custom reward: `async fn(args, sample) -> float` (or a group of samples with group_rm)."""
    group_rm: bool = False
    """custom_rm_path scores a whole group: `async fn(args, samples) -> list[float]`."""
    rm_url: str | None = None
    """URL of the remote reward model (rm_type remote_rm)."""
    reward_workers: int = 0
    """Processes that score rule-based rewards (rm_type deepscaler|dapo|math|f1|tiny_task, boxed_ forms)
    off the controller's event loop, on its node; 0: on the loop. Worth it when answers are symbolic
    (fractions, roots: 1.5-2.8 ms of sympy per sample on the loop, 0.15 ms with a pool); integer-only data
    (DAPO-Math) is cheaper on the loop. Custom and remote rewards stay on the loop."""
    answer_parse_workers: int = 0
    """Processes that make the /generate exchanges with the engines and parse the answers (JSON to token and
    log-prob arrays) off the controller's process, on its node; 0: on the event loop. Worth it at full
    response lengths and many engines: reading and parsing the answers was most of the controller's CPU per
    sample (docs/scaling.md). With them, rule rewards (rm_type, not remote_rm or custom_rm_path) of the built-in
    single-turn generate are scored in these workers too, always (no flag): the same value, and the controller
    scores a sample itself whenever that cannot be proved (a custom generate function, a resumed partial sample,
    a changed text or label, a grader error: rollout/worker_rewards.py)."""
    num_rollout: int | None = None
    """Number of rollout steps (None: derived from num_epoch and the data size)."""
    num_epoch: int | None = None
    """Passes over the prompt data when num_rollout is not given."""
    rollout_batch_size: int = 8
    """Prompt groups per rollout step."""
    n_samples_per_prompt: int = 8
    """Samples per prompt (the GRPO group size)."""
    rollout_max_response_len: int = 1024
    """Maximum new tokens per sample."""
    rollout_max_context_len: int | None = None
    """Maximum prompt + response tokens (None: no extra limit)."""
    rollout_max_prompt_len: int | None = None
    """Longest prompt (tokens, chat template applied) a rollout uses; longer ones are dropped when drawn,
    counted (rollout/prompts_too_long) and the first named by its data row. None: rollout_max_context_len - 1,
    else what leaves the engines room for one response token."""
    reward_timeout: float = 300.0
    """Seconds one reward call may take (a sample's; a group's with group_rm). Custom rewards run in a thread
    of their own, never on the controller's event loop; one that takes longer is an error naming the sample
    and the reward function."""
    rollout_temperature: float = 1.0
    """Sampling temperature."""
    rollout_top_p: float = 1.0
    """Nucleus sampling threshold."""
    rollout_top_k: int = -1
    """Top-k sampling (-1: off)."""
    rollout_stop: list[str] | None = None
    """Stop strings."""
    rollout_stop_token_ids: list[int] | None = None
    """Stop token ids (besides EOS)."""
    over_sampling_batch_size: int | None = None
    """Prompt groups per refill when dynamic sampling is on (default: rollout_batch_size)."""
    dynamic_sampling_filter_path: str | None = None
    """Import path of the group filter: `fn(args, samples, **kwargs) -> bool | result`
    (built in: hpc_rl.rollout.filters.check_reward_nonzero_std)."""
    partial_rollout: bool = False
    """Keep unfinished groups (with their partial tokens) for the next rollout instead of dropping them."""
    mask_offpolicy_in_partial_rollout: bool = False
    """Loss-mask tokens of a partial sample that an older policy generated."""
    buffer_filter_path: str | None = None
    """Import path of `fn(args, rollout_id, buffer, num_samples) -> list[list[Sample]]` (default: FIFO)."""
    buffer_sort_by_staleness: bool = False
    """The partial-rollout buffer resumes the groups with the oldest generated-token weight version first (slime's
    --buffer-sort-by-staleness); buffer_filter_path, when given, takes precedence."""
    custom_generate_function_path: str | None = None
    """Import path of `async fn(args, sample, sampling_params) -> Sample` (multi-turn, tools)."""
    max_turns: int | None = None
    """Turn limit handed to custom_generate_function_path as `args.max_turns` (needs that path)."""
    reward_key: str | None = None
    """When the custom reward or the reward server returns an object, the key holding the reward (slime's
    --reward-key)."""
    rollout_sample_hook_path: list[str] = field(default_factory=list)
    """Import paths of slime's sample hooks, `hook(args, sample, *, rollout_id=, evaluation=) -> Sample | None`,
    applied in order to every generated sample before its reward (rollout and eval; the flag repeats)."""
    rollout_sample_filter_path: str | None = None
    """Import path of slime's `fn(args, groups)` marking `sample.remove_sample` on the kept groups: those samples
    are not trained (loss mask zeros) but stay in their group's reward normalisation."""
    rollout_all_samples_process_path: str | None = None
    """Import path of slime's `fn(args, all_samples, data_source)`, called with every scored group of the
    rollout (those dynamic sampling dropped too) and hpc_rl's prompt source."""
    custom_rollout_log_function_path: str | None = None
    """Import path of slime's `fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool`, called
    after each rollout; True skips hpc_rl's rollout/* scalars of that rollout."""
    custom_config_path: str | None = None
    """YAML file of extra values for your plug-ins: each top-level key becomes an attribute of the `args` they
    receive (slime's --custom-config-path; keys that name a config field are refused: set those as flags)."""
    http_proxy: str | None = None
    """HTTP proxy for the calls to the reward server (rm_type remote_rm; slime's --http-proxy)."""
    custom_reward_post_process_path: str | None = None
    """Import path of slime's `fn(args, samples) -> (raw_rewards, rewards)`, called on the controller with each
    rollout's samples; its rewards replace the group-normalised ones the trainer receives. slime's on-policy-
    distillation one (slime.rollout.on_policy_distillation.post_process_rewards) is hpc_rl's
    hpc_rl.rollout.teacher.distillation_post_process: rewards 0, the teacher at rm_url (distillation.opd_teacher_url)."""
    update_weights_interval: int = 1
    """Sync weights to the engines every this many rollouts."""
    update_weight_buffer_size: int = 512 * 1024**2
    """Bytes per weight-broadcast bucket."""
    update_weight_transport: WeightTransport = "nccl"
    """How weights reach decoupled engines: nccl (a broadcast group from trainer rank 0; gloo on CPU) or disk (the
    trainer writes an HF directory under update_weight_disk_dir, the engines load it with
    /update_weights_from_disk: for trainer and engines in separate jobs or partitions; slime's
    --update-weight-transport)."""
    update_weight_mode: str = "full"
    """full: every sync sends every weight (slime's delta mode is not offered)."""
    update_weight_disk_dir: str | None = None
    """With transport disk: a directory trainer and engines both see; each sync writes weights_v<version> there."""
    update_weight_disk_keep_files: bool = False
    """With transport disk: keep every version's directory (default: the previous one is removed once the engines
    loaded the new one)."""
    flush_cache_interval: int = 1
    """Async mode, decoupled engines, transport nccl: 1 (the default) has the rollout generated ahead finish
    before each sync and the engines flush their KV cache at every sync. N > 1 updates in place (PipelineRL):
    the sync pauses the engines with their running requests and KV cache kept, loads the new weights and the
    same requests go on (each token records the version it came from: TIS/MIS see the mix); every N-th sync
    flushes the cache instead (the engines retract their requests first, as SGLang requires). 0: never flush
    (slime's --flush-cache-interval; refused with --colocate, as slime does)."""
    custom_update_weight_post_write_path: str | None = None
    """Import path of slime's `hook(args, version_dir, rollout_engines)`, called on every trainer rank after a disk
    sync's files are written and before the engines read them (rollout_engines: the engines' URLs here)."""
    rollout_external_engine_addrs: list[str] = field(default_factory=list)
    """SGLang servers this job did not start (host:port or http://host:port; e.g. an inference job on another
    partition), used as the job's engines instead of starting any: health-checked (one that stops answering is
    waited for, then given the current weights), weights pushed over the weight-update group or, with
    update_weight_transport disk, through the shared filesystem. They must not need an api key other than the
    job's, and must reach trainer rank 0's node for the group (slime's --rollout-external-engine-addrs)."""
    rollout_session_id: str | None = None
    """Names the rollout session: the engines a run attaches to and the rollouts it retained (generated, not
    trained: journaled under run_dir/retained whenever save_interval is set). A resume with the same id trains the
    retained rollouts first instead of generating them again; another id drops them and says so (slime's
    --rollout-session-id; docs/faults.md, "Retained rollouts")."""
    rollout_cleanup_timeout: float = 600.0
    """Seconds an engine job's engines (`python -m hpc_rl.submit CONFIG --engines-for RUN_DIR`) wait without a
    controller (the trainer's job ended, failed or is requeued) before they stop; a new controller in that time gets
    them back (slime's --rollout-cleanup-timeout; docs/engine-jobs.md)."""
    max_staleness: int | None = None
    """Async mode: no sample is trained more than this many weight versions after its first token."""
    async_rollout: bool = False
    """Generate rollout k+1 while training on rollout k (bounded by max_staleness)."""

    engine: EngineKind = "auto"
    """Rollout engine: sglang (real SGLang, on cuda or cpu), cpu (hpc_rl's CPU engine, cluster.device cpu)
    or auto (sglang on cuda, cpu on cpu)."""
    # Training modes (SFT): slime's names.
    rollout_function_path: str = SGLANG_ROLLOUT
    """slime's rollout function: slime.rollout.sglang_rollout.generate_rollout (generate with the engines) or
    slime.rollout.sft_rollout.generate_rollout (SFT: the data's chats, loss on the assistant turns, no engines)."""
    loss_mask_type: MaskRendering = "qwen"
    """SFT: how a chat's turns are rendered for their loss masks (slime's --loss-mask-type): qwen (each message
    rendered by the chat template alone) | qwen3 (each message rendered after a user turn, as in a conversation:
    Qwen3's template then adds its empty think block). Any chat template works with either (GLM's too)."""

    def __post_init__(self) -> None:
        raise_problems(literal_problems(self, "rollout"))
        if self.over_sampling_batch_size is None:
            self.over_sampling_batch_size = self.rollout_batch_size


@dataclass(kw_only=True)
class SGLangConfig:
    """Options passed to each SGLang server (`--sglang-X` on the CLI becomes `--X` on the server)."""

    server_concurrency: int = 512
    """Maximum in-flight requests per engine from the controller."""
    mem_fraction_static: float | None = None
    """SGLang --mem-fraction-static."""
    cuda_graph_bs: list[int] | None = None
    """SGLang --cuda-graph-bs."""
    router_policy: RouterPolicy = "cache_aware"
    """sglang-router policy: cache_aware | round_robin | power_of_two | random."""
    extra_args: dict[str, Any] = field(default_factory=dict)
    """Any other server option by SGLang name (e.g. {enable_memory_saver: true})."""

    def __post_init__(self) -> None:
        raise_problems(literal_problems(self, "sglang"))

    def server_options(self) -> dict[str, Any]:
        """All options for `sglang.launch_server`, by SGLang's own names."""
        options = dict(self.extra_args)
        if self.mem_fraction_static is not None:
            options["mem_fraction_static"] = self.mem_fraction_static
        if self.cuda_graph_bs is not None:
            options["cuda_graph_bs"] = self.cuda_graph_bs
        return options


@dataclass(kw_only=True)
class EvalDataset:
    """One eval dataset: a name for the metrics and a path (and, from an --eval-config file, its own settings;
    None: the eval section's)."""

    name: str
    """Metric prefix (eval/<name>/...)."""
    path: str
    """jsonl/parquet path."""
    n_samples_per_eval_prompt: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_response_len: int | None = None
    min_new_tokens: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    input_key: str | None = None
    label_key: str | None = None
    tool_key: str | None = None
    metadata_key: str | None = None


@dataclass(kw_only=True)
class EvalConfig:
    """Periodic evaluation rollouts."""

    eval_interval: int | None = None
    """Evaluate every this many rollouts (None: never)."""
    eval_prompt_data: list[EvalDataset] = field(default_factory=list)
    """Name/path pairs (CLI: --eval-prompt-data aime /path/aime.jsonl gsm8k /path/gsm8k.jsonl)."""
    n_samples_per_eval_prompt: int = 1
    """Samples per eval prompt."""
    eval_max_response_len: int | None = None
    """Max new tokens in eval (default: rollout_max_response_len)."""
    eval_temperature: float | None = None
    """Eval temperature (default: rollout_temperature)."""
    eval_top_p: float | None = None
    """Eval top-p (default: rollout_top_p)."""
    eval_top_k: int | None = None
    """Eval top-k (default: rollout_top_k)."""
    skip_eval_before_train: bool = False
    """Do not evaluate the initial policy."""
    eval_reward_key: str | None = None
    """reward_key for eval rewards (default: reward_key; slime's --eval-reward-key)."""
    eval_input_key: str | None = None
    """input_key of the eval data (default: rollout.input_key; slime's --eval-input-key)."""
    eval_label_key: str | None = None
    """label_key of the eval data (default: rollout.label_key)."""
    eval_tool_key: str | None = None
    """tool_key of the eval data (default: rollout.tool_key)."""
    eval_max_prompt_len: int | None = None
    """Eval prompts longer than this many tokens (chat template applied) are left out, with a log line naming how
    many (slime's --eval-max-prompt-len)."""
    eval_max_context_len: int | None = None
    """Maximum prompt + response tokens in eval (default: rollout.rollout_max_context_len)."""
    eval_min_new_tokens: int | None = None
    """SGLang's min_new_tokens for eval sampling (slime's --eval-min-new-tokens)."""
    eval_config: str | None = None
    """YAML (or JSON) file of eval datasets, slime's --eval-config: `eval: {defaults: {...}, datasets: [{name, path,
    ...}]}` (or that mapping at the top level); each dataset may set n_samples_per_eval_prompt, temperature, top_p,
    top_k, max_response_len, min_new_tokens, stop, stop_token_ids, input_key, label_key, tool_key and
    metadata_key, defaults for all. Read when the config is loaded; it replaces eval_prompt_data."""
    custom_eval_rollout_log_function_path: str | None = None
    """Import path of slime's `fn(rollout_id, args, data, extra_metrics) -> bool` (data: {name: {rewards,
    truncated, samples}}), called after each eval; True skips hpc_rl's eval/<name>/* scalars."""
