"""C declarations for the llama.h and ggml-backend.h subset kvrt drives.

Copied by hand from the headers of the llama.cpp that llama-cpp-python 0.3.36 vendors.
ABI mode has no compiler to check them, so :mod:`kvrt.bindings._loader` cross-checks
every struct size against llama-cpp-python's own ctypes layout before first use.
Enum-typed struct fields are declared as ``int`` (C enums are int-sized) so that
enums kvrt never sets need not be copied.
"""

CDEF = r"""
typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;
typedef uint32_t llama_state_seq_flags;

struct llama_vocab;
struct llama_model;
struct llama_context;
struct llama_sampler;
struct llama_memory_i;
typedef struct llama_memory_i * llama_memory_t;
struct ggml_tensor;

struct ggml_backend_device;
typedef struct ggml_backend_device * ggml_backend_dev_t;
struct ggml_backend_buffer_type;
typedef struct ggml_backend_buffer_type * ggml_backend_buffer_type_t;
struct ggml_backend_buffer;
typedef struct ggml_backend_buffer * ggml_backend_buffer_t;
struct ggml_backend_reg;
typedef struct ggml_backend_reg * ggml_backend_reg_t;

typedef bool (*ggml_abort_callback)(void * data);
typedef bool (*ggml_backend_sched_eval_callback)(struct ggml_tensor * t, bool ask, void * user_data);
typedef bool (*llama_progress_callback)(float progress, void * user_data);
typedef void (*ggml_log_callback)(int level, const char * text, void * user_data);

typedef struct llama_batch {
    int32_t n_tokens;
    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
} llama_batch;

struct llama_model_params {
    ggml_backend_dev_t * devices;
    const void * tensor_buft_overrides;
    int32_t n_gpu_layers;
    int split_mode;
    int load_mode;
    int lazy_mode;
    int32_t main_gpu;
    const float * tensor_split;
    llama_progress_callback progress_callback;
    void * progress_callback_user_data;
    const void * kv_overrides;
    bool vocab_only;
    bool check_tensors;
    bool use_extra_bufts;
    bool no_host;
    bool no_alloc;
    bool load_mtp;
};

struct llama_sampler_seq_config {
    llama_seq_id seq_id;
    struct llama_sampler * sampler;
};

struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    uint32_t n_rs_seq;
    uint32_t n_outputs_max;
    uint32_t n_outputs_max_per_seq;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    int ctx_type;
    int rope_scaling_type;
    int pooling_type;
    int attention_type;
    int flash_attn_type;
    float    rope_freq_base;
    float    rope_freq_scale;
    float    yarn_ext_factor;
    float    yarn_attn_factor;
    float    yarn_beta_fast;
    float    yarn_beta_slow;
    uint32_t yarn_orig_ctx;
    float    defrag_thold;
    ggml_backend_sched_eval_callback cb_eval;
    void * cb_eval_user_data;
    int type_k;
    int type_v;
    ggml_abort_callback abort_callback;
    void *              abort_callback_data;
    bool embeddings;
    bool offload_kqv;
    bool no_perf;
    bool op_offload;
    bool swa_full;
    bool kv_unified;
    struct llama_sampler_seq_config * samplers;
    size_t n_samplers;
    struct llama_context * ctx_other;
};

typedef struct llama_sampler_chain_params {
    bool no_perf;
} llama_sampler_chain_params;

struct llama_perf_context_data {
    double t_start_ms;
    double t_load_ms;
    double t_p_eval_ms;
    double t_eval_ms;
    int32_t n_p_eval;
    int32_t n_eval;
    int32_t n_reused;
};

struct ggml_backend_dev_caps {
    bool async;
    bool host_buffer;
    bool buffer_from_host_ptr;
    bool events;
    bool mmap_support;
};

struct ggml_backend_dev_props {
    const char * name;
    const char * description;
    size_t memory_free;
    size_t memory_total;
    int type;
    const char * device_id;
    struct ggml_backend_dev_caps caps;
};

const char * llama_version(void);
const char * llama_print_system_info(void);
bool llama_supports_gpu_offload(void);
bool llama_supports_mmap(void);
size_t llama_max_devices(void);
size_t llama_max_parallel_sequences(void);
int64_t llama_time_us(void);
void llama_log_set(ggml_log_callback log_callback, void * user_data);
void llama_log_get(ggml_log_callback * log_callback, void ** user_data);

typedef struct llama_chat_message { const char * role; const char * content; } llama_chat_message;
int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
                                  bool add_ass, char * buf, int32_t length);
const char * llama_model_chat_template(const struct llama_model * model, const char * name);
struct llama_model_params   llama_model_default_params(void);
struct llama_context_params llama_context_default_params(void);
struct llama_sampler_chain_params llama_sampler_chain_default_params(void);

void llama_backend_init(void);
void llama_backend_free(void);

struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);
struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);

uint32_t llama_n_ctx(const struct llama_context * ctx);
uint32_t llama_n_ctx_seq(const struct llama_context * ctx);
uint32_t llama_n_batch(const struct llama_context * ctx);
uint32_t llama_n_ubatch(const struct llama_context * ctx);
uint32_t llama_n_seq_max(const struct llama_context * ctx);
const struct llama_model * llama_get_model(const struct llama_context * ctx);
llama_memory_t llama_get_memory(const struct llama_context * ctx);

const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
int32_t llama_model_n_ctx_train(const struct llama_model * model);
int32_t llama_model_n_embd(const struct llama_model * model);
int32_t llama_model_n_layer(const struct llama_model * model);
int32_t llama_model_n_head(const struct llama_model * model);
int32_t llama_model_n_head_kv(const struct llama_model * model);
int32_t llama_model_n_swa(const struct llama_model * model);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
uint64_t llama_model_size(const struct llama_model * model);
uint64_t llama_model_n_params(const struct llama_model * model);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
bool llama_model_is_recurrent(const struct llama_model * model);
bool llama_model_is_hybrid(const struct llama_model * model);

int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
llama_token llama_vocab_eos(const struct llama_vocab * vocab);
bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);
int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf,
                             int32_t length, int32_t lstrip, bool special);
int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                         char * text, int32_t text_len_max, bool remove_special, bool unparse_special);

void llama_memory_clear(llama_memory_t mem, bool data);
bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
void llama_memory_seq_keep(llama_memory_t mem, llama_seq_id seq_id);
void llama_memory_seq_add(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos delta);
llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);
bool llama_memory_can_shift(llama_memory_t mem);

size_t llama_state_get_size(struct llama_context * ctx);
size_t llama_state_get_data(struct llama_context * ctx, uint8_t * dst, size_t size);
size_t llama_state_set_data(struct llama_context * ctx, const uint8_t * src, size_t size);
size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);
size_t llama_state_seq_get_size_ext(struct llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags);
size_t llama_state_seq_get_data_ext(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id, llama_state_seq_flags flags);
size_t llama_state_seq_set_data_ext(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id, llama_state_seq_flags flags);

struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
void llama_batch_free(struct llama_batch batch);
int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
void llama_set_abort_callback(struct llama_context * ctx, ggml_abort_callback abort_callback, void * abort_callback_data);
void llama_synchronize(struct llama_context * ctx);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
bool llama_set_sampler(struct llama_context * ctx, llama_seq_id seq_id, struct llama_sampler * smpl);
llama_token llama_get_sampled_token_ith(struct llama_context * ctx, int32_t i);

struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
int32_t llama_sampler_chain_n(const struct llama_sampler * chain);
struct llama_sampler * llama_sampler_init_greedy(void);
struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
struct llama_sampler * llama_sampler_init_top_k(int32_t k);
struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_temp(float t);
struct llama_sampler * llama_sampler_clone(const struct llama_sampler * smpl);
void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
void llama_sampler_reset(struct llama_sampler * smpl);
void llama_sampler_free(struct llama_sampler * smpl);
llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
typedef struct llama_token_data { llama_token id; float logit; float p; } llama_token_data;
typedef struct llama_token_data_array {
    llama_token_data * data;
    size_t size;
    int64_t selected;
    bool sorted;
} llama_token_data_array;
void llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p);
struct llama_sampler * llama_sampler_init_grammar(const struct llama_vocab * vocab, const char * grammar_str,
                                                  const char * grammar_root);
typedef struct llama_logit_bias { llama_token token; float bias; } llama_logit_bias;
struct llama_sampler * llama_sampler_init_logit_bias(int32_t n_vocab, int32_t n_logit_bias,
                                                     const llama_logit_bias * logit_bias);
struct llama_sampler * llama_sampler_init_penalties(int32_t n_vocab, int32_t penalty_last_n, float penalty_repeat,
                                                    float penalty_freq, float penalty_present);

struct llama_perf_context_data llama_perf_context(const struct llama_context * ctx);
void llama_perf_context_reset(struct llama_context * ctx);
"""

GGML_CDEF = r"""
struct ggml_backend_feature { const char * name; const char * value; };
typedef struct ggml_backend_feature * (*ggml_backend_get_features_t)(ggml_backend_reg_t reg);
typedef ggml_backend_buffer_type_t * (*ggml_backend_dev_get_extra_bufts_t)(ggml_backend_dev_t device);
void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t device);
ggml_backend_dev_t ggml_backend_dev_by_type(int type);
size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
const char * ggml_backend_dev_name(ggml_backend_dev_t device);
const char * ggml_backend_dev_description(ggml_backend_dev_t device);
void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
int ggml_backend_dev_type(ggml_backend_dev_t device);
void ggml_backend_dev_get_props(ggml_backend_dev_t device, struct ggml_backend_dev_props * props);
ggml_backend_buffer_type_t ggml_backend_dev_buffer_type(ggml_backend_dev_t device);
ggml_backend_buffer_type_t ggml_backend_dev_host_buffer_type(ggml_backend_dev_t device);
size_t ggml_backend_reg_count(void);
ggml_backend_reg_t ggml_backend_reg_get(size_t index);
const char * ggml_backend_reg_name(ggml_backend_reg_t reg);
void ggml_backend_load_all(void);

const char * ggml_backend_buft_name(ggml_backend_buffer_type_t buft);
ggml_backend_buffer_t ggml_backend_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size);
size_t ggml_backend_buft_get_alignment(ggml_backend_buffer_type_t buft);
bool ggml_backend_buft_is_host(ggml_backend_buffer_type_t buft);

const char * ggml_backend_buffer_name(ggml_backend_buffer_t buffer);
void ggml_backend_buffer_free(ggml_backend_buffer_t buffer);
void * ggml_backend_buffer_get_base(ggml_backend_buffer_t buffer);
size_t ggml_backend_buffer_get_size(ggml_backend_buffer_t buffer);
bool ggml_backend_buffer_is_host(ggml_backend_buffer_t buffer);
void ggml_backend_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value);
ggml_backend_buffer_t ggml_backend_cpu_buffer_from_ptr(void * ptr, size_t size);
ggml_backend_buffer_type_t ggml_backend_cpu_buffer_type(void);
"""
