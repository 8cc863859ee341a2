package config

// The keys of TensorRT-LLM's files that kvxfer knows. The rule (issue #12):
// a key kvxfer does not read is a warning ("not used by kvxfer"); it is an
// error only when it is a near miss of a key kvxfer reads (a typo: "did you
// mean"), or when it sits in a block kvxfer owns or TensorRT-LLM keeps strict
// (cache_transceiver_config, security, disagg_cluster,
// conditional_disagg_config). The lists below are the TensorRT-LLM keys
// kvxfer knows it does not use: they are never taken for typos (without
// them moe_tensor_parallel_size would be a near miss of
// tensor_parallel_size), and their warning says they are known. A list kept
// by hand lags upstream; that only costs a plainer warning.

// llmAPIKnown are LLM API options (TorchLlmArgs, TrtLlmArgs, and their
// older forms) other than the ones kvxfer reads.
var llmAPIKnown = []string{
	// BaseLlmArgs
	"model", "tokenizer", "tokenizer_mode", "custom_tokenizer", "skip_tokenizer_init", "trust_remote_code", "dtype",
	"revision", "tokenizer_revision", "model_kwargs", "context_parallel_size", "gpus_per_node",
	"moe_cluster_parallel_size", "moe_tensor_parallel_size", "moe_expert_parallel_size", "enable_attention_dp",
	"enable_lm_head_tp_in_adp", "pp_partition", "cp_config", "load_format", "enable_lora", "lora_config",
	"enable_chunked_prefill", "guided_decoding_backend", "batched_logits_processor", "iter_stats_max_iterations",
	"request_stats_max_iterations", "peft_cache_config", "scheduler_config", "sparse_attention_config",
	"speculative_config", "max_batch_size", "max_input_len", "max_seq_len", "max_beam_width", "max_num_tokens",
	"gather_generation_logits", "num_postprocess_workers", "postprocess_tokenizer_dir", "reasoning_parser",
	"decoding_config", "otlp_traces_endpoint", "backend", "return_perf_metrics", "perf_metrics_max_requests",
	"orchestrator_type", "env_overrides", "telemetry_config",
	// trtllm-serve options that cluster files give per group or at the top level
	"free_gpu_memory_fraction", "server_role", "metadata_server_config",
	// TorchLlmArgs
	"garbage_collection_gen0_threshold", "cuda_graph_config", "attention_dp_config", "disable_overlap_scheduler",
	"moe_config", "nvfp4_gemm_config", "attn_backend", "sampler_type", "sampler_force_async_worker",
	"enable_iter_perf_stats", "enable_iter_req_stats", "print_iter_log", "batch_wait_timeout_ms",
	"batch_wait_timeout_iters", "batch_wait_max_tokens_ratio", "torch_compile_config", "enable_autotuner",
	"enable_layerwise_nvtx_marker", "enable_min_latency", "stream_interval", "force_dynamic_quantization",
	"allreduce_strategy", "checkpoint_loader", "checkpoint_format", "kv_connector_config", "mm_encoder_only",
	"enable_mixed_sampler", "kv_cache_dtype", "ray_worker_extension_cls", "enable_sleep",
	// TrtLlmArgs
	"enable_tqdm", "workspace", "fail_fast_on_attention_window_too_large", "enable_build_cache",
	"extended_runtime_perf_knob_config", "calib_config", "quant_config", "embedding_parallel_mode", "fast_build",
	"build_config", "enable_prompt_adapter", "max_prompt_adapter_token", "batching_type", "normalize_log_probs",
	// older forms (mid-2025 and before)
	"pytorch_backend_config", "use_cuda_graph", "cuda_graph_batch_sizes", "cuda_graph_padding_enabled",
	"cuda_graph_max_batch_size", "enable_overlap_scheduler", "autotuner_enabled",
}

// kvCacheKnown are the kv_cache_config keys kvxfer does not read.
var kvCacheKnown = []string{
	"max_attention_window", "sink_token_length", "free_gpu_memory_fraction",
	"host_cache_size", "onboard_blocks", "cross_kv_cache_fraction", "secondary_offload_min_priority",
	"use_uvm", "dtype",
	"mamba_ssm_cache_dtype", "attention_dp_events_gather_period_ms", "max_gpu_total_bytes",
	"use_kv_cache_manager_v2", "max_util_for_resume",
}

// clusterKeys are the top-level keys of a cluster file that belong to the
// disaggregated server itself. Every other top-level key is an LLM API
// option for both server groups.
var clusterKeys = []string{
	"hostname", "port", "context_servers", "generation_servers", "disagg_cluster", "conditional_disagg_config",
	"otlp_config", "max_retries", "perf_metrics_max_requests", "return_perf_metrics", "perf_metrics_output_dir",
	"node_id", "schedule_style", "allow_request_chat_template", "gen_strip_message_history", "gen_tokids_ctxbytes",
	"num_workers", "disagg_coordinator_url",
	"security", // kvxfer's own
}

// clusterKnown are the cluster keys kvxfer does not read.
var clusterKnown = []string{
	"otlp_config", "max_retries", "perf_metrics_max_requests", "return_perf_metrics", "perf_metrics_output_dir",
	"node_id", "schedule_style", "allow_request_chat_template", "gen_strip_message_history", "gen_tokids_ctxbytes",
	"num_workers", "disagg_coordinator_url",
}

// routerKnown are router keys of TensorRT-LLM's policies that kvxfer does
// not use (RouterArgs are the ones it does).
var routerKnown = []string{"args", "server_role", "use_tokens", "use_token_ids", "max_num_tokens"}

// groupKeys are the keys of a server group that are not LLM API options.
var groupKeys = []string{"num_instances", "urls", "router"}

// clusterMarkers are the keys that make a file a cluster file. A file whose
// keys are all cluster keys and include disagg_cluster is one too (the
// router's file of a cluster whose workers register themselves).
var clusterMarkers = []string{"context_servers", "generation_servers"}

// Names of settings the loader and the annotated output refer to.
const (
	keySenderTimeout     = "kv_transfer_sender_future_timeout_ms"
	keyRuntime           = "transceiver_runtime"
	keyConditionalDisagg = "conditional_disagg_config"
	keyDisaggCluster     = "disagg_cluster"
)

// notAppliedYet are the settings kvxfer checks but does not apply yet, each
// with what happens instead; the loader warns about each one that is set.
// An entry goes away in the change that gives its setting an effect.
var notAppliedYet = map[string]string{}

// envNotApplied are TensorRT-LLM variables of the transfer path that
// kvxfer reads only to say that they have no effect.
var envNotApplied = map[string]string{
	"TRTLLM_NIXL_KVCACHE_BACKEND":              "not applicable: kvxfer has no NIXL backend",
	"TRTLLM_DISABLE_KV_CACHE_TRANSFER_OVERLAP": "not applied: kvxfer's executor always overlaps transfers with other work",
	"TRTLLM_ENABLE_KVCACHE_RECEIVE_PARALLEL":   "not applied: kvxfer has no such switch",
	"TRTLLM_KVCACHE_TRANSFER_USE_ASYNC_BUFFER": "not applicable: kvxfer's staging buffers are host memory, allocated once",
}
