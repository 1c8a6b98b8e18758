"""The config schema: the reference's ``model``, ``training``, ``execution`` and ``checkpoint`` sections
(same key names), plus ``data``, ``output_dir`` and the plugins' own sections under ``plugins``.

Defaults are the reference's where they exist; where ipuft differs, the field's comment says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional


class Precision(str, Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class OptimizerPlacement(str, Enum):
    device = "device"  # each update-only phase brings weights, optimizer state and gradient to the device
    host = "host"  # the optimizer updates them in place in host memory, where they live (ZeRO-Offload's choice)


class DataFormat(str, Enum):
    tokens = "tokens"  # rows hold input_ids
    text = "text"  # rows hold one text field (data.text_field)
    template = "template"  # rows are rendered through data.template
    instruction = "instruction"  # rows hold a prompt and a response (data.prompt_field, data.response_field)
    chat = "chat"  # rows hold messages, rendered through the checkpoint's chat template
    preference = "preference"  # rows hold a prompt and a chosen and a rejected completion (TRL's columns)


class Truncation(str, Enum):
    error = "error"  # an example longer than sequence_length + 1 is one error line
    drop = "drop"  # it is left out; preparation reports how many were
    truncate = "truncate"  # its first sequence_length + 1 tokens (and their loss mask) are kept


class PreferenceLoss(str, Enum):
    dpo = "dpo"  # the sigmoid loss of Direct Preference Optimization, against the reference's log-probs
    ipo = "ipo"  # Identity Preference Optimization's squared loss, against the reference's
    simpo = "simpo"  # SimPO: reference-free, of length-normalised log-probs, with a margin simpo_gamma


class Schedule(str, Enum):
    constant = "constant"  # the reference's: warm-up, then constant
    linear = "linear"  # warm-up, then linear decay to zero at the last step
    cosine = "cosine"  # warm-up, then cosine decay to zero at the last step


@dataclass
class EmbeddingConfig:
    vocab_size: int = 50400


@dataclass
class AttentionConfig:
    heads: int = 16
    # The rotary base (Hugging Face's rope_theta: 10000 for GPT-J, 500000.0 for Llama 3).
    rotary_positional_embeddings_base: float = 10000
    rotary_dim: int = 64


@dataclass
class ModelConfig:
    layers: int = 28
    hidden_size: int = 4096
    # GPT-J's MLP width; null means 4 × hidden_size, as Hugging Face's n_inner=None does.
    intermediate_size: Optional[int] = None
    sequence_length: int = 2048
    # Roles whose variables are all frozen (no gradient, no optimizer state, no update), for example
    # [embeddings, head] with a LoRA decoder. A component may also freeze some of its own variables.
    freeze: list[str] = field(default_factory=list)
    dropout_prob: float = 0.0
    # The dtype of the stored weights, of the compute and of the activation buffers. Loss, softmax, layer-norm
    # statistics, gradient accumulation, the global norm and the optimizer stay float32. The reference used
    # float16 (with loss scaling); the default stays float32, which needs neither rounding recipe.
    precision: Precision = Precision.float32
    seed: int = 42
    layer_norm_epsilon: float = 1e-5
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    # The head's projection is the embeddings' table (Hugging Face's tie_word_embeddings): one matrix, stored,
    # trained and exported once. model.hf_checkpoint sets it from config.json.
    tie_embeddings: bool = False
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    # Which registered component builds each role (see `ipuft plugins`).
    embeddings: str = "gptj"
    decoder: str = "gptj"
    head: str = "gptj"
    # A parameter-efficient fine-tuning method an installed plugin applies to the components: null (every
    # weight trains), or lora (ipuft-lora: low-rank adapters on the decoder's projections, every base weight
    # frozen; its options are plugins.lora).
    adapter: Optional[str] = None
    # The Hugging Face architecture (config.json's model_type) the model is, for `ipuft export`: gptj, or
    # one an installed plugin registers (llama, mistral, qwen2). model.hf_checkpoint sets it.
    family: str = "gptj"
    # A local Hugging Face directory (config.json and safetensors or pytorch_model*.bin weights) to initialise
    # from; its config.json's model_type picks the family, which sets the components and the shapes.
    hf_checkpoint: Optional[str] = None
    # The model's special tokens, as its config.json has them (a Hugging Face checkpoint's sets them; an export
    # writes them back): generation stops a row at any of eos_token_ids (unset: the tokenizer's <|endoftext|>).
    # Prompts start with what the tokenizer itself adds (its post-processor), never a forced bos_token_id.
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    # An ipuft checkpoint (or a run directory's latest) whose weights start a new run: step 0, fresh
    # optimizer state and data position (checkpoint.load resumes a run instead). Its config sets the shapes.
    init_checkpoint: Optional[str] = None


@dataclass
class LearningRateConfig:
    maximum: float = 0.01
    warmup_proportion: float = 0.0
    schedule: Schedule = Schedule.constant


@dataclass
class OptimizerConfig:
    # The optimizer plugin's name; its own hyperparameters live in its config section (adamw's in
    # plugins.adamw). The schedule and global-norm clipping are core's, whatever the optimizer.
    name: str = "adamw"
    learning_rate: LearningRateConfig = field(default_factory=LearningRateConfig)
    gradient_clipping: float = 1.0


@dataclass
class PreferenceConfig:
    # data.format=preference: the loss of each pair (chosen and rejected completions of one prompt), its beta
    # (the reward's scale; IPO's tau), SimPO's target margin gamma (in units of the reward), and the weight of
    # an SFT term, the chosen completion's mean token cross-entropy, added to each pair's loss (RPO's alpha).
    loss: PreferenceLoss = PreferenceLoss.dpo
    beta: float = 0.1
    simpo_gamma: float = 0.5
    sft_weight: float = 0.0


@dataclass
class TrainingConfig:
    steps: int = 1
    # Passes over the data's rows (data.path, as packed: chunks or examples): with it, training.steps becomes
    # ceil(epochs × rows / global_batch_size) and the learning-rate schedule and warm-up follow those steps (the
    # last step may take its tail from the next pass's order); null: training.steps. A fraction is allowed.
    epochs: Optional[float] = None
    global_batch_size: int = 32
    # Stop when this many optimizer steps in a row are skipped for a non-finite loss or gradient norm.
    max_consecutive_skips: int = 10
    # Evaluate on data.validation_path every N steps and at the last step (0: never); the validation loss,
    # perplexity and token count join that step's record in metrics.jsonl.
    eval_steps: int = 0
    # How a 16-bit weight takes its float32 update (model.precision bfloat16/float16); at most one of the two:
    # - stochastic_rounding: the update is computed in float32 and rounded stochastically into the 16-bit
    #   weight (the reference's recipe; no master copy, so 2 bytes per weight);
    # - master_weights: a float32 master copy in the optimizer state takes the update and the 16-bit weight
    #   is cast from it (4 more bytes per weight, the most exact).
    # Neither: round to nearest, where updates smaller than half a 16-bit step vanish.
    stochastic_rounding: bool = False
    master_weights: bool = False
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)


@dataclass
class ExecutionConfig:
    micro_batch_size: int = 1
    data_parallel: int = 1
    tensor_parallel: int = 1
    # A fixed scale (the reference used 4096 with float16), or "dynamic": halve on overflow, double after
    # loss_scaling_growth_interval clean steps, starting from loss_scaling_initial.
    loss_scaling: Any = 1.0
    loss_scaling_initial: float = 65536.0
    loss_scaling_growth_interval: int = 1000
    device: Device = Device.auto
    # Keep weights, optimizer state and gradients in host memory and stream them per phase. auto (with recompute:
    # the finetune recipe's): the run's plan decides (ipuft.run.layout): resident where the run fits with a margin.
    offload: Any = True
    # Where the optimizer runs. host (with offload=true): in host memory, in place, from the stored gradient;
    # weights, Adam state and gradients never come to the device for an update (see docs/how-a-step-runs.md).
    optimizer_placement: OptimizerPlacement = OptimizerPlacement.device
    # Where the x/dx activation buffers live between phases: false (on the compute device), true (in host
    # memory; "host" says the same, "none" the same as false), or disk: each layer boundary's x entries are
    # written to files under execution.spill_dir in the forward and read back, a layer ahead, in the backward
    # (dx, which lives only for the rows in flight, and the head's input stay in host memory).
    activation_offload: Any = False
    # With activation_offload=disk: the directory the x entries are spilled into (each rank its own files, in a
    # directory of its own that the run removes at its end); null: the run directory's spill/.
    spill_dir: Optional[str] = None
    # Recompute each layer's forward in its backward (the reference's): only layer inputs stay between phases.
    # false: each layer's forward keeps what its backward needs, for every micro-batch, until that backward
    # (L × GA micro-batches' saved tensors at once, on the device; ipuft plan counts them). It needs the
    # weights resident and whole: execution.offload=false, activation_offload=false, rts=false. auto: false where
    # the plan says one process keeps it all within the device's free memory with a margin (ipuft.run.layout).
    recompute: Any = True
    # Replicated tensor sharding over the data-parallel ranks; null means "on when data_parallel > 1".
    rts: Optional[bool] = None
    # How long a collective waits for a peer rank before the run stops with one line (a dead or stopped rank).
    collective_timeout_s: float = 300.0
    # Keep host memory a step frees for the next step's tensors (glibc's mallopt, process-wide), instead of
    # returning it to the kernel and page-faulting it back 4 KiB at a time (see ipuft.hostmem).
    retain_host_memory: bool = True
    # An update on the device brings the unit's weights, optimizer state and gradient to it piece by piece,
    # at most this many bytes of them per optimizer call (two pieces at once on CUDA, where the next one's
    # copy overlaps the current one's update); 0 loads the whole unit first (see docs/how-a-step-runs.md).
    update_piece_bytes: int = 64 * 2**20
    # The head's loss and its gradient are computed this many tokens at a time (the float32 logits of one
    # chunk at once, not of a whole micro-batch); 0 computes all of a micro-batch's tokens at once.
    head_chunk_tokens: int = 512
    # Above 1: the head's weight gradient is made this many vocabulary slices at a time after the micro-batches'
    # losses, each slice summed over every micro-batch and written into the stored gradient, so that the whole
    # float32 gradient is never on the device (the logits' matmul runs once more); 0 or 1: all at once.
    head_vocab_slices: int = 0


@dataclass
class CheckpointConfig:
    # An ipuft checkpoint, or a run directory (its latest checkpoint), to take the weights from.
    load: Optional[str] = None
    # Where to save; the default is the run directory's checkpoints/; null disables saving.
    save: Optional[str] = "<output_dir>/checkpoints"
    steps: int = 0  # save every N steps (0: only at the end)
    to_keep: int = 4
    optim_state: bool = True
    # Resuming checks that the model's shape, the global batch, the loss scaling, the precision recipe and
    # the optimizer are those the checkpoint was saved with; keys listed here may differ.
    allow_changes: list[str] = field(default_factory=list)


@dataclass
class DataConfig:
    # A local .jsonl/.json, .csv, .tsv, .parquet or .txt file, or "mnli-sample" (shipped with ipuft);
    # null: synthetic token sequences (no tokenizer needed).
    path: Optional[str] = None
    # data.path a Hugging Face dataset (a save_to_disk directory, a directory of Parquet or Arrow shards, or a
    # dataset's name in the local datasets cache; needs ipuft[datasets]): its split and subset (config name).
    split: str = "train"
    subset: Optional[str] = None
    format: DataFormat = DataFormat.template
    # A named template ("mnli") or a literal one with {field} placeholders; with a named template, the loss
    # of unpacked examples covers only the target.
    template: str = "mnli"
    text_field: str = "text"
    # data.format=instruction: a named template ("alpaca": Stanford Alpaca's, with or without its input) or
    # a literal one with {field} placeholders, whose target (the only text in the loss) starts at its
    # {<data.response_field>} placeholder; the fields of the prompt, of the optional input (alpaca's
    # "input"; null: none) and of the response.
    instruction_template: str = "alpaca"
    prompt_field: str = "instruction"
    input_field: Optional[str] = "input"
    response_field: str = "output"
    # data.format=chat: the field holding [{role, content}, ...] (roles system, user, assistant), and the chat
    # template (a literal Jinja template or a file holding one; null: the tokenizer's, from its
    # tokenizer_config.json chat_template or chat_template.jinja). The loss covers the assistant turns only.
    messages_field: str = "messages"
    chat_template: Optional[str] = None
    # Bounds on rendering one row through a template (data.template, data.instruction_template, a chat
    # template): the characters it may yield (a format width or precision above it is refused before
    # formatting), and a chat template's wall-clock seconds per rendering. Real templates stay far inside both
    # (a row is kB, a rendering takes a millisecond); a breach is one line naming the template and the row.
    template_max_chars: int = 1 << 24
    template_seconds: float = 10.0
    # Concatenate examples and cut chunks of sequence_length + 1 (the reference's group_texts; every token in
    # the loss for tokens, text and template, the masks kept for instruction and chat); false pads each
    # example and masks padding (and the prompt, where the template marks a target) out of the loss.
    packing: bool = True
    # With packing, keep every example whole in one row (rows filled greedily, in order, the rest padded out
    # of the loss), its loss mask kept and its positions restarting at 0 (Batch.positions), so that an
    # attention that honours them keeps examples apart; false: concatenate and cut as above, masks kept.
    # null: true for data.format=instruction and chat, false for tokens, text and template.
    whole_examples: Optional[bool] = None
    # An example longer than sequence_length + 1 unpacked, or packed whole: error, drop (counted, reported
    # once) or truncate (its start kept). null: truncate for instruction and chat (as torchtune and TRL do),
    # error for tokens, text and template.
    truncation: Optional[Truncation] = None
    # data.format=preference with data.truncation=truncate: keep a prompt's last this many tokens (null: all of it)
    # before a completion is cut to fit the row.
    max_prompt_tokens: Optional[int] = None
    # With packing, end each text or template example with the tokenizer's end-of-sequence token (its
    # tokenizer_config.json's eos_token), unless it already ends with it, so the model learns where documents
    # end; an instruction example's response ends with it packed or not (Stanford Alpaca's), in the loss. A
    # chat example ends as its template ends its turns. Either way each text, template or instruction example
    # is encoded as the tokenizer encodes a text: with what its post-processor adds (Llama 3's
    # <|begin_of_text|> first; nothing for Qwen2, SmolLM2 or GPT-J); a chat example as transformers encodes a
    # rendered chat, with nothing added (its template writes its own bos).
    add_eos: bool = True
    shuffle: bool = True
    seed: int = 0
    # Rows to evaluate on every training.eval_steps: a file like data.path (same format, template, packing
    # and tokenizer), read in order, each row once.
    validation_path: Optional[str] = None
    # data.path a Hugging Face dataset: another split of it as the validation rows (say "test").
    validation_split: Optional[str] = None
    # Keep the tokenized data in a memory-mapped cache (IPUFT_CACHE_DIR, else ~/.cache/ipuft), keyed by the
    # file's and the tokenizer's hashes and the settings above, so that a second run starts at once.
    cache: bool = True
    # Or hold out this fraction of data.path's rows (examples, or packed chunks), drawn by data.seed:
    # training never sees them.
    validation_fraction: float = 0.0
    # A directory holding tokenizer.json, or the file itself, or "sample" (shipped with ipuft);
    # null: the tokenizer of model.hf_checkpoint.
    tokenizer: Optional[str] = None


@dataclass
class LoggingConfig:
    # Where each step's metrics go besides metrics.jsonl (always written; "jsonl" names it): the logging
    # backends plugins register, such as tensorboard or wandb (see `ipuft plugins`).
    backends: list[str] = field(default_factory=lambda: ["jsonl"])


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Run directory; null means runs/<timestamp>.
    output_dir: Optional[str] = None
    # Derived: global_batch_size / (data_parallel × micro_batch_size). Setting it is an error.
    gradient_accumulation: Optional[int] = None
