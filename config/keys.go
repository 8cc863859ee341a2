package config

// TensorRT-LLM keys that kvxfer knows and accepts but that have no effect in
// kvxfer: they are listed as warnings, never as errors, so that a TRT-LLM
// file loads as it is. Keys that nobody knows are errors.

// llmAPIIgnored are LLM API options (TorchLlmArgs) other than the ones
// kvxfer reads.
var llmAPIIgnored = []string{
	"model", "tokenizer", "tokenizer_mode", "skip_tokenizer_init", "trust_remote_code", "dtype", "revision",
	"tokenizer_revision", "context_parallel_size", "gpus_per_node", "moe_cluster_parallel_size",
	"moe_tensor_parallel_size", "moe_expert_parallel_size", "enable_attention_dp", "cp_config", "load_format",
	"enable_lora", "lora_config", "enable_prompt_adapter", "max_prompt_adapter_token", "quant_config",
	"enable_chunked_prefill", "guided_decoding_backend", "batched_logits_processor", "iter_stats_max_iterations",
	"request_stats_max_iterations", "peft_cache_config", "scheduler_config", "speculative_config",
	"max_batch_size", "max_input_len", "max_seq_len", "max_beam_width", "max_num_tokens",
	"gather_generation_logits", "num_postprocess_workers", "postprocess_tokenizer_dir", "reasoning_parser",
	"garbage_collection_gen0_threshold", "backend", "build_config", "cuda_graph_config",
	"disable_overlap_scheduler", "moe_config", "attn_backend", "sampler_type", "enable_iter_perf_stats",
	"enable_iter_req_stats", "print_iter_log", "torch_compile_config", "enable_autotuner",
	"enable_layerwise_nvtx_marker", "enable_min_latency", "stream_interval", "force_dynamic_quantization",
	"allreduce_strategy", "checkpoint_loader", "checkpoint_format", "kv_connector_config", "mm_encoder_only",
	"batch_wait_timeout_ms", "batch_wait_timeout_iters", "batch_wait_max_tokens_ratio", "return_perf_metrics",
	"orchestrator_type", "perf_metrics_max_requests", "enable_mixed_sampler", "use_cuda_graph",
	"cuda_graph_batch_sizes", "cuda_graph_padding_enabled", "kv_cache_dtype", "fail_fast_on_attention_window_too_large",
}

// kvCacheIgnored are kv_cache_config keys other than tokens_per_block and
// max_tokens.
var kvCacheIgnored = []string{
	"enable_block_reuse", "max_attention_window", "sink_token_length", "free_gpu_memory_fraction",
	"host_cache_size", "onboard_blocks", "cross_kv_cache_fraction", "secondary_offload_min_priority",
	"event_buffer_max_size", "enable_partial_reuse", "copy_on_partial_reuse", "use_uvm", "dtype",
	"mamba_ssm_cache_dtype", "attention_dp_events_gather_period_ms", "max_gpu_total_bytes",
}

// clusterIgnored are top-level disagg_config.yaml keys kvxfer ignores.
var clusterIgnored = []string{
	"backend", "free_gpu_memory_fraction", "conditional_disagg_config", "otlp_config", "max_retries",
	"perf_metrics_max_requests", "disagg_cluster", "node_id", "schedule_style", "trust_remote_code", "model",
}

// routerIgnored are router keys kvxfer ignores.
var routerIgnored = []string{"args", "server_role", "use_tokens"}

// clusterMarkers are the keys that make a file a cluster file.
var clusterMarkers = []string{"context_servers", "generation_servers"}
