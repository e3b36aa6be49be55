#include "llama-turboq-center.h"
#include "llama-turboq.h"

#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"
#include "llama-model-loader.h"
#include "llama-context.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-hybrid-iswa.h"

#include "ggml-backend.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#include <stdexcept>
#include <string>
#include <system_error>

#if defined(__linux__) || defined(__APPLE__)
#include <climits>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__APPLE__)
#include <crt_externs.h>
#define TQ_ENVIRON (*_NSGetEnviron())
#else
extern char ** environ;
#define TQ_ENVIRON environ
#endif
#endif

// the rotation's signs (ggml-turboq.h, not on libllama's include path): a part of the calibration cache's key
extern "C" void ggml_turboq_signs(const float ** s1, const float ** s2);

namespace {

constexpr uint32_t K_MEAN_MAGIC       = 0x534b5154; // "TQKS": the calibrated mean and channel scale
constexpr uint32_t K_MEAN_MAGIC_SEED  = 0x444b5154; // "TQKD": the same, then the former TURBOQ_SIGN_SEED's seed
constexpr uint32_t K_MEAN_MAGIC_NOSC  = 0x434b5154; // "TQKC": a calibrated mean without the scale (earlier build)
constexpr uint32_t K_MEAN_MAGIC_OLD   = 0x4d4b5154; // "TQKM": a mean fixed by the first write (before calibration)

// Tokens of this text (the first CALIBRATION_TOKENS, the text repeated if it is shorter) are the
// calibration input. It mixes prose, dialogue, code, numbers and another language, so that no
// one register sets the mean, and it is none of the texts the project evaluates on.
constexpr const char * CALIBRATION_TEXT = R"TQ(The lighthouse keeper kept two notebooks. In the first he wrote the weather every four hours: wind from the north-west at twenty knots, visibility six miles, a falling glass. In the second he wrote everything else. "Saw the ferry turn back at noon," one entry reads. "Mrs. Okafor brought bread and the news that the school roof leaks again. Fixed the hinge on the lower door. Read until the lamp needed trimming."
When the station was automated in 1987, the notebooks went to the county archive, where a student found them forty years later and counted 14,612 entries. Most were ordinary. A few were not: a night in March when three ships answered the horn at once, a summer so dry that the spring behind the cottage failed, a letter copied out in full because, he wrote, "some things should be kept twice."
Q: How do you convert a temperature from Celsius to Fahrenheit?
A: Multiply by 9, divide by 5, and add 32. For example, 25 degrees Celsius is 25 * 9 / 5 + 32 = 77 degrees Fahrenheit.
def moving_average(values, window):
    """Return the mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. The light reactions take place in the thylakoid membranes, where chlorophyll absorbs mostly red and blue light and reflects green; the Calvin cycle, in the stroma, fixes carbon with the help of the enzyme rubisco, which is thought to be the most abundant protein on Earth.
Meeting notes, Tuesday. Attendees: Priya, Tomasz, Lena, Marcus. 1) The release moves to the 14th because the migration script failed on the staging database. 2) Lena will write the rollback plan. 3) Budget: travel is frozen until the end of the quarter; training requests go through Marcus. Action items are due Friday.
Il pleuvait depuis le matin, et la place du marché était presque vide. Un vieil homme vendait encore des pommes sous une bâche bleue.
She opened the window and listened. Somewhere below, a dog barked twice and stopped; a car door closed; a radio played the end of a song she almost knew. "Are you coming?" her brother called from the stairs. "In a minute," she said, which they both understood to mean ten.
The recipe calls for 250 g of flour, 2 eggs, 300 ml of milk and a pinch of salt. Whisk the eggs and milk, add the flour a little at a time, and let the batter rest for thirty minutes before cooking it in a hot, lightly oiled pan.
In 1859, the Carrington event produced auroras seen as far south as the Caribbean; telegraph operators reported sparks from their equipment, and some lines kept working with the batteries disconnected, powered by the current induced in the wires.
SELECT customer_id, COUNT(*) AS orders, SUM(total) AS revenue
FROM orders
WHERE created_at >= '2024-01-01'
GROUP BY customer_id
ORDER BY revenue DESC
LIMIT 10;
The theorem says that every continuous function on a closed interval attains a maximum and a minimum. The proof uses the fact that the interval is compact: any sequence in it has a subsequence that converges to a point of the interval, and continuity carries the limit through the function.
)TQ";

constexpr int CALIBRATION_TOKENS = 512;

std::mutex g_calibration_mutex;

// passes errors on, drops the calibration context's own lines (its cache and buffer sizes, and
// warnings that belong to it, not to the user's context)
struct log_filter {
    ggml_log_callback cb;
    void * user_data;
    bool drop = false;
};

void log_filtered(ggml_log_level level, const char * text, void * user_data) {
    auto * f = (log_filter *) user_data;
    if (level != GGML_LOG_LEVEL_CONT) {
        f->drop = level < GGML_LOG_LEVEL_ERROR;
    }
    if (!f->drop && f->cb) {
        f->cb(level, text, f->user_data);
    }
}

std::vector<llama_token> calibration_tokens(const llama_vocab * vocab, int n) {
    const std::string text = CALIBRATION_TEXT;
    std::vector<llama_token> toks(text.size() + 16);
    int got = llama_tokenize(vocab, text.c_str(), (int32_t) text.size(), toks.data(), (int32_t) toks.size(), true, false);
    if (got < 0) {
        toks.resize(-got);
        got = llama_tokenize(vocab, text.c_str(), (int32_t) text.size(), toks.data(), (int32_t) toks.size(), true, false);
    }
    if (got <= 0) {
        return {};
    }
    toks.resize(got);
    // the text once more without the special tokens, until there are n
    std::vector<llama_token> more(text.size() + 16);
    const int n_more = llama_tokenize(vocab, text.c_str(), (int32_t) text.size(), more.data(), (int32_t) more.size(), false, false);
    while ((int) toks.size() < n && n_more > 0) {
        toks.insert(toks.end(), more.begin(), more.begin() + n_more);
    }
    toks.resize(std::min<size_t>(toks.size(), n));
    return toks;
}

// Layer il's K rows in the cells of kv that hold tokens, with their positions; false when kv has no
// such layer or no such cell
bool cache_k_rows(const llama_kv_cache * kv, uint32_t il, std::vector<float> & rows, std::vector<llama_pos> & pos,
                  int64_t & n_embd) {
    const std::vector<uint32_t> ids = kv->get_layer_ids();
    if (std::find(ids.begin(), ids.end(), il) == ids.end()) {
        return false;
    }
    const ggml_tensor * k = kv->get_k_storage((int32_t) il);
    const llama_kv_cells & cells = kv->get_cells(0);
    n_embd = k->ne[0];
    const auto * traits = ggml_get_type_traits(k->type);
    std::vector<uint8_t> raw(k->nb[1]);
    rows.clear();
    pos.clear();
    for (uint32_t i = 0; i < cells.size(); ++i) {
        if (cells.is_empty(i)) {
            continue;
        }
        ggml_backend_tensor_get(k, raw.data(), (size_t) i*k->nb[1], raw.size());
        rows.resize(rows.size() + n_embd);
        traits->to_float(raw.data(), rows.data() + rows.size() - n_embd, n_embd);
        pos.push_back(cells.pos_get(i));
    }
    return !pos.empty();
}

// The RoPE angle per position of each rotated pair of layer il (n_rot/2 values), as the model's
// graph computes it with the default context parameters (per-layer base and scale, the model's
// frequency factors; YaRN's ramp is left out); empty when the layer's rotation is not one angle
// per pair and position (no RoPE, M-RoPE, vision)
std::vector<double> rope_angles(const llama_model & model, uint32_t il) {
    const llama_hparams & hp = model.hparams;
    if (hp.rope_type != LLAMA_ROPE_TYPE_NORM && hp.rope_type != LLAMA_ROPE_TYPE_NEOX) {
        return {};
    }
    const int64_t n_rot = hp.n_rot(il);
    if (n_rot < 2 || n_rot % 2 != 0 || n_rot > (int64_t) hp.n_embd_head_k(il)) {
        return {};
    }
    const double base  = hp.is_swa(il) ? hp.rope_freq_base_train_swa  : hp.rope_freq_base_train;
    const double scale = hp.is_swa(il) ? hp.rope_freq_scale_train_swa : hp.rope_freq_scale_train;
    std::vector<float> factors;
    if (il < model.layers.size() && model.layers[il].rope_freqs != nullptr &&
        model.layers[il].rope_freqs->type == GGML_TYPE_F32 && ggml_nelements(model.layers[il].rope_freqs) == n_rot/2) {
        factors.resize(n_rot/2);
        ggml_backend_tensor_get(model.layers[il].rope_freqs, factors.data(), 0, factors.size()*sizeof(float));
    }
    std::vector<double> theta(n_rot/2);
    for (int64_t i = 0; i < n_rot/2; ++i) {
        theta[i] = scale*std::pow(base, -2.0*i/n_rot) / (factors.empty() || factors[i] == 0.0f ? 1.0 : factors[i]);
    }
    return theta;
}

// The calibration's statistics of one layer's K, n = n_embd_k_gqa floats each, kept by the model
// (model.turboq_k_mean[il], K_N_STATS*n floats); k_mean_for turns them into mu and s for a span
enum k_stat { K_MEAN, K_VAR, K_PRE, K_SQ, Q_ENERGY, K_N_STATS };

// the channels (c0, c1) of rotated pair i of head h, which RoPE turns as c0 + i*c1: NEOX pairs
// (i, i + half), the others (2i, 2i + 1); half = n_rot/2 pairs of a head of d channels
struct rope_pair { int64_t c0, c1; };
static rope_pair rope_pair_at(bool neox, int64_t d, int64_t half, int64_t h, int64_t i) {
    return { h*d + (neox ? i : 2*i), h*d + (neox ? i + half : 2*i + 1) };
}

// the RoPE partner of channel c within a head of d channels (c itself when c is not rotated)
int64_t rope_partner(const llama_hparams & hp, uint32_t il, int64_t c) {
    const int64_t n_rot = std::min<int64_t>(hp.n_rot(il), hp.n_embd_head_k(il));
    if (hp.rope_type == LLAMA_ROPE_TYPE_NONE || c >= n_rot) {
        return c;
    }
    return hp.rope_type != LLAMA_ROPE_TYPE_NORM ? (c < n_rot/2 ? c + n_rot/2 : c - n_rot/2) : (c ^ 1);
}

// K's statistics over the calibration rows: the mean and centered mean square per channel (as
// the rows lie, at positions 0..n-1), the mean square, and the pre-RoPE mean: each rotated pair
// (x + iy) turned back to position 0 by its angle, then averaged (the plain mean elsewhere)
void k_stats(const llama_model & model, uint32_t il, const std::vector<float> & rows, const std::vector<llama_pos> & pos,
             int64_t n_embd, std::vector<float> & out) {
    const llama_hparams & hp = model.hparams;
    const size_t n = pos.size();
    std::vector<double> sum(n_embd, 0.0), sum2(n_embd, 0.0);
    for (size_t r = 0; r < n; ++r) {
        for (int64_t j = 0; j < n_embd; ++j) {
            const double x = rows[r*n_embd + j];
            sum[j]  += x;
            sum2[j] += x*x;
        }
    }
    out.assign(K_N_STATS*n_embd, 0.0f);
    float * mean = out.data() + K_MEAN*n_embd;
    float * var  = out.data() + K_VAR*n_embd;
    float * pre  = out.data() + K_PRE*n_embd;
    float * sq   = out.data() + K_SQ*n_embd;
    for (int64_t j = 0; j < n_embd; ++j) {
        const double m = sum[j]/n;
        mean[j] = (float) m;
        var[j]  = (float) std::max(0.0, sum2[j]/n - m*m);
        pre[j]  = (float) m;
        sq[j]   = (float) (sum2[j]/n);
    }
    const std::vector<double> theta = rope_angles(model, il);
    const int64_t d = hp.n_embd_head_k(il);
    if (theta.empty() || hp.n_lora_kv > 0 || n_embd % d != 0) {
        return;
    }
    const int64_t half = (int64_t) theta.size();
    const bool neox = hp.rope_type == LLAMA_ROPE_TYPE_NEOX;
    for (int64_t h = 0; h < n_embd/d; ++h) {
        for (int64_t i = 0; i < half; ++i) {
            const auto [c0, c1] = rope_pair_at(neox, d, half, h, i);
            double mr = 0.0, mi = 0.0;
            for (size_t r = 0; r < n; ++r) {
                const double a = -theta[i]*pos[r];
                const double x = rows[r*n_embd + c0], y = rows[r*n_embd + c1];
                mr += x*std::cos(a) - y*std::sin(a);
                mi += x*std::sin(a) + y*std::cos(a);
            }
            pre[c0] = (float) (mr/n);
            pre[c1] = (float) (mi/n);
        }
    }
}

// Q's mean square per layer and channel ([n_head][n_embd_head]), from the calibration graph's
// post-RoPE "Qcur-<il>" tensors (the Q that attention reads)
struct q_moments {
    std::vector<std::vector<double>> sum2; // per layer: n_head*n_embd_head
    std::vector<int64_t> n_head;
    std::vector<int64_t> n_rows;
    std::vector<float> buf;
};

bool collect_q(ggml_tensor * t, bool ask, void * user_data) {
    const bool want = t->op == GGML_OP_ROPE && t->type == GGML_TYPE_F32 && std::strncmp(t->name, "Qcur-", 5) == 0;
    if (ask || !want) {
        return want;
    }
    auto * m = (q_moments *) user_data;
    const int il = std::atoi(t->name + 5);
    if (il < 0 || il >= (int) m->sum2.size() || !ggml_is_contiguous(t)) {
        return true;
    }
    const int64_t d = t->ne[0], h = t->ne[1], n = ggml_nelements(t) / (d*h);
    m->buf.resize((size_t) ggml_nelements(t));
    ggml_backend_tensor_get(t, m->buf.data(), 0, ggml_nbytes(t));
    auto & acc = m->sum2[il];
    if (acc.empty()) {
        acc.assign((size_t) (d*h), 0.0);
        m->n_head[il] = h;
    }
    if (m->n_head[il] != h) {
        return true;
    }
    for (int64_t r = 0; r < n; ++r) {
        const float * x = m->buf.data() + r*d*h;
        for (int64_t j = 0; j < d*h; ++j) {
            acc[j] += (double) x[j]*x[j];
        }
    }
    m->n_rows[il] += n;
    return true;
}

bool k_balancing() {
    const char * env = std::getenv("TURBOQ_K_BALANCE"); // debug: 0 turns the channel scale off
    return env == nullptr || std::strcmp(env, "0") != 0;
}

// The channel scale s of one layer (one value per K channel of every KV head): the cache stores
// (k - mu)*s, attention reads it with q/s, so q.k is unchanged; the quantization error e (about
// the same in every rotated coordinate) reaches the logit as sum q_c e_c / s_c. With a_c = E[q_c^2]
// (over the KV head's query heads) and b_c = E[(k_c - mu_c)^2], s_c = (a_c/b_c)^(1/4) minimizes
// that error's variance for a given ||s*(k - mu)||. RoPE turns each channel pair by the position,
// so a pair shares one s (from its summed energy): the scale then commutes with RoPE and does not
// drift with the position. Normalized to a geometric mean of 1 per head.
std::vector<float> channel_scale(const llama_hparams & hp, uint32_t il, const float * a, const std::vector<double> & b) {
    const int64_t d    = hp.n_embd_head_k(il);
    const int64_t n_kv = (int64_t) b.size() / d;
    std::vector<float> s(b.size(), 1.0f);
    for (int64_t j = 0; j < n_kv; ++j) {
        double am = 0.0, bm = 0.0;
        for (int64_t c = 0; c < d; ++c) {
            am += a[j*d + c]/d;
            bm += b[j*d + c]/d;
        }
        if (!(am > 0.0) || !(bm > 0.0)) {
            continue;
        }
        std::vector<double> e(d);
        double log_sum = 0.0;
        for (int64_t c = 0; c < d; ++c) {
            const int64_t p = rope_partner(hp, il, c);
            const double ap = a[j*d + c] + (p != c ? a[j*d + p] : 0.0) + 1e-3*am;
            const double bp = b[j*d + c] + (p != c ? b[j*d + p] : 0.0) + 1e-3*bm;
            e[c] = std::min(1e3, std::max(1e-3, std::pow(ap/bp, 0.25)));
            log_sum += std::log(e[c]);
        }
        const double norm = std::exp(log_sum/d);
        for (int64_t c = 0; c < d; ++c) {
            s[j*d + c] = (float) (e[c]/norm);
        }
    }
    return s;
}

// E[q^2] per K channel ([n_kv][d], averaged over the KV head's query heads), into out; left at 0
// (no scale) where the Q statistics are missing or do not fit. MLA caches keep the rotary part
// after the rest, and their K is read as V too: no scale.
void q_energy(const llama_hparams & hp, uint32_t il, const std::vector<double> & q2, int64_t n_head, int64_t q_rows,
              int64_t n_embd, float * out) {
    const int64_t d    = hp.n_embd_head_k(il);
    const int64_t n_kv = n_embd / d;
    if (q2.empty() || q_rows == 0 || n_kv == 0 || n_head % n_kv != 0 || (int64_t) q2.size() != n_head*d || hp.n_lora_kv > 0) {
        return;
    }
    const int64_t gqa = n_head / n_kv;
    for (int64_t j = 0; j < n_kv; ++j) {
        for (int64_t c = 0; c < d; ++c) {
            double acc = 0.0;
            for (int64_t g = 0; g < gqa; ++g) {
                acc += q2[(j*gqa + g)*d + c];
            }
            out[j*d + c] = (float) (acc/((double) gqa*q_rows));
        }
    }
}

// mu then s of layer il for a cache whose sequences span `span` positions (0: the calibration's).
// Centering subtracts one constant vector from every key after RoPE; that is exact (q.mu is the
// same for all of a query's keys) but only useful where the keys' mean is about constant. A RoPE
// pair turns by its angle per position, so the calibration's 512 positions alone give a mean
// that stops fitting thousands of positions later on every pair that turns a little over 512
// positions and a lot over the context. So the mean is that of a key spread evenly over the span:
// the pre-RoPE mean m times A = (1/span) sum_p e^(i p theta), with E|k - A m|^2 = E|k|^2 - |A m|^2.
std::vector<float> k_mean_for(const llama_model & model, uint32_t il, const std::vector<float> & st, int64_t span) {
    const llama_hparams & hp = model.hparams;
    const int64_t n = (int64_t) st.size() / K_N_STATS;
    std::vector<float> out(st.begin() + K_MEAN*n, st.begin() + (K_MEAN + 1)*n);
    std::vector<double> var(st.begin() + K_VAR*n, st.begin() + (K_VAR + 1)*n);
    const std::vector<double> theta = span > 0 && hp.n_lora_kv == 0 ? rope_angles(model, il) : std::vector<double>();
    const int64_t d = hp.n_embd_head_k(il);
    if (!theta.empty() && n % d == 0) {
        const int64_t half = (int64_t) theta.size();
        const bool neox = hp.rope_type == LLAMA_ROPE_TYPE_NEOX;
        const float * pre = st.data() + K_PRE*n;
        const float * sq  = st.data() + K_SQ*n;
        for (int64_t h = 0; h < n/d; ++h) {
            for (int64_t i = 0; i < half; ++i) {
                const auto [c0, c1] = rope_pair_at(neox, d, half, h, i);
                // A = (1 - e^(i span theta)) / (span (1 - e^(i theta)))
                double ar = 1.0, ai = 0.0;
                if (std::fabs(std::remainder(theta[i], 2.0*M_PI)) > 1e-9) {
                    const double nr = 1.0 - std::cos(span*theta[i]), ni = -std::sin(span*theta[i]);
                    const double dr = span*(1.0 - std::cos(theta[i])), di = -span*std::sin(theta[i]);
                    const double dd = dr*dr + di*di;
                    ar = (nr*dr + ni*di)/dd;
                    ai = (ni*dr - nr*di)/dd;
                }
                const double ur = ar*pre[c0] - ai*pre[c1], ui = ar*pre[c1] + ai*pre[c0];
                const double v  = std::max(0.0, (double) sq[c0] + sq[c1] - ur*ur - ui*ui)/2;
                out[c0] = (float) ur;
                out[c1] = (float) ui;
                var[c0] = var[c1] = v;
            }
        }
    }
    const std::vector<float> sc = channel_scale(hp, il, st.data() + Q_ENERGY*n, var);
    out.insert(out.end(), sc.begin(), sc.end());
    return out;
}

// the model's means from a calibration context; false (with the reason) when it cannot be run
bool run_calibration(llama_model & model, const llama_context_params & user, std::string & why) {
    const std::vector<llama_token> toks = calibration_tokens(llama_model_get_vocab(&model), CALIBRATION_TOKENS);
    if (toks.empty()) {
        why = "the model's vocabulary cannot tokenize the calibration text";
        return false;
    }
    if (llama_model_has_encoder(&model)) {
        why = "an encoder-decoder model";
        return false;
    }
    const uint32_t n = (uint32_t) toks.size();

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = n;
    cp.n_batch         = n;
    cp.n_ubatch        = n;
    cp.n_seq_max       = 1;
    cp.n_outputs_max   = 1;
    cp.n_threads       = user.n_threads;
    cp.n_threads_batch = user.n_threads_batch;
    cp.type_k          = GGML_TYPE_F16;
    cp.type_v          = GGML_TYPE_F16;
    cp.offload_kqv     = user.offload_kqv;
    cp.op_offload      = user.op_offload;
    cp.swa_full        = true; // every calibration token stays in every layer's cache
    cp.no_perf         = true;

    const uint32_t n_layer = model.hparams.n_layer();
    q_moments qm;
    qm.sum2.resize(n_layer);
    qm.n_head.assign(n_layer, 0);
    qm.n_rows.assign(n_layer, 0);
    if (k_balancing()) {
        cp.cb_eval           = collect_q;
        cp.cb_eval_user_data = &qm;
    }

    llama_context * ctx = llama_init_from_model(&model, cp);
    if (!ctx) {
        why = "the calibration context could not be created";
        return false;
    }
    llama_batch batch = llama_batch_get_one(const_cast<llama_token *>(toks.data()), (int32_t) n);
    const int32_t rc = llama_decode(ctx, batch);
    bool ok = rc == 0;
    if (!ok) {
        why = "the calibration decode failed (" + std::to_string(rc) + ")";
    }

    // the caches that hold attention layers: plain, sliding-window pairs, hybrid models
    std::vector<const llama_kv_cache *> caches;
    llama_memory_i * mem = ctx->get_memory();
    if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        caches.push_back(kv);
    } else if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        caches.push_back(iswa->get_base());
        caches.push_back(iswa->get_swa());
    } else if (auto * hyb = dynamic_cast<llama_memory_hybrid *>(mem)) {
        caches.push_back(hyb->get_mem_attn());
    } else if (ok) {
        ok = false;
        why = "its memory is not a KV cache that calibration can read";
    }

    // per layer: K's and Q's statistics (model.turboq_k_mean, see k_stat)
    std::vector<std::vector<float>> means(n_layer);
    for (uint32_t il = 0; ok && il < n_layer; ++il) {
        std::vector<float> rows;
        std::vector<llama_pos> pos;
        int64_t n_embd = 0;
        bool found = false;
        for (const auto * kv : caches) {
            if ((found = cache_k_rows(kv, il, rows, pos, n_embd))) {
                break;
            }
        }
        if (!found) {
            continue;
        }
        k_stats(model, il, rows, pos, n_embd, means[il]);
        q_energy(model.hparams, il, qm.sum2[il], qm.n_head[il], qm.n_rows[il], n_embd, means[il].data() + Q_ENERGY*n_embd);
    }
    llama_free(ctx);
    if (ok) {
        model.turboq_k_mean = std::move(means);
    }
    return ok;
}

// ---- the calibration cache ------------------------------------------------------------------------
//
// The statistics (model.turboq_k_mean: K_N_STATS*n_embd_k_gqa floats per layer, the input of
// k_mean_for for every span) are a function of what the calibration reads, so they are kept on
// disk and read back at the next load instead of running the prefill again (3-8 s per load of
// Gemma 3 270M on 2 cores, 20-40 s for an 8B shape). A file holds the floats exactly as computed,
// so a cached and a fresh calibration give the same bits, and a state saved under one restores
// under the other.
//
// The file is found by a key (key_text) of everything the floats depend on; any difference is
// another file, and a file whose stored key is not this one is recomputed:
//   - the model: a digest of every byte of every split (file_digest), and the load's kv_overrides
//     (they change hparams and the vocabulary) except pyturbo's own turboq.* keys, which the
//     calibration context does not read: its cache is f16, so the exact window (quantized caches
//     only) is off, the layer-adaptive mode reads as 0 while calibrating, and k_center only decides
//     whether a calibration runs;
//   - where it runs, because a GPU, another CPU kernel or a BLAS library gives other floats: every
//     backend device of the process (name and description, the CPU's model included), each
//     backend's features (the CPU's instruction sets choose its kernels), the model's devices
//     (the context offloads large-batch ops to them, op_offload), the buffer type of every weight
//     (-ngl, -ot, split mode, CPU repacking), offload_kqv and op_offload, the process's GGML_*
//     environment (upstream's backend switches, e.g. GGML_CUDA_FORCE_CUBLAS, choose kernels), and
//     the build: size and mtime of the libraries that hold libllama, ggml-base and each backend
//     (a rebuild can change a kernel; it costs one calibration);
//   - the calibration: CALIBRATION_VERSION, a digest of CALIBRATION_TEXT, CALIBRATION_TOKENS, and
//     TURBOQ_K_BALANCE (0: no Q statistics);
//   - the build's rotation signs (a digest of turboq_sign1/2, and the seed of a seeded build): the
//     f16 calibration does not read them, but a build with other signs keeps its own files;
//   - the byte order of the floats.
// Not in it: the thread count (each output of the CPU kernels is computed by one thread; -t 1 and
// -t 2 write the same bytes), the user's context parameters other than the two offload flags (the
// calibration context has its own: 512 tokens, f16 K and V, one sequence, no adapters), mmap.
//
// Where: $PYTURBO_CACHE/k-calibration, else $XDG_CACHE_HOME/pyturbo/k-calibration, else
// $HOME/.cache/pyturbo/k-calibration (pyturbo/_paths.py's cache_dir()), one file per key,
// <model digest>-<key digest>.kcal (hex). A directory that cannot be created or written, and a
// model without a file to digest (loaded from a buffer, a platform without the file's path), mean
// no cache: the calibration runs as before, and the log line says why. A read touches the file;
// writing one removes the files that no load read for 30 days (prune_cache): a rebuild, an RPC
// server on another port, leave files of keys that will not come again.
//
// Format (little-endian on every supported platform; the key names the byte order):
//   "TQKCACHE", u32 CACHE_FORMAT, u32 key length, the key text (name=value lines), u32 n_layer,
//   n_layer x u32 (floats of layer il, 0 for a layer without K statistics), the floats,
//   u32 CRC-32 (zlib's) of every byte before it.
// It is written to a temporary file in the same directory and renamed over the name, so a reader
// in another process sees the old file or the whole new one; a short, corrupt or unreadable file
// is recomputed (and rewritten), never read.

// Bump when the calibration's statistics change: what is computed, or how (k_stats, q_energy,
// the calibration context's parameters)
constexpr int      CALIBRATION_VERSION = 1;
constexpr uint32_t CACHE_FORMAT        = 1; // the file layout above
constexpr char     CACHE_MAGIC[8]      = { 'T', 'Q', 'K', 'C', 'A', 'C', 'H', 'E' };
constexpr size_t   CACHE_MAX_BYTES     = size_t(1) << 30; // more is not a calibration file
constexpr auto     CACHE_KEEP          = std::chrono::hours(24*30); // a file not read for this long is removed
constexpr auto     CACHE_KEEP_TMP      = std::chrono::hours(24);    // a temporary file this old: its writer died

// XXH64 (Yann Collet's xxHash, 64-bit), one-shot
constexpr uint64_t XXH_P1 = 11400714785074694791ULL;
constexpr uint64_t XXH_P2 = 14029467366897019727ULL;
constexpr uint64_t XXH_P3 =  1609587929392839161ULL;
constexpr uint64_t XXH_P4 =  9650029242287828579ULL;
constexpr uint64_t XXH_P5 =  2870177450012600261ULL;

inline uint64_t xxh_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t xxh_read64(const uint8_t * p) { uint64_t v; std::memcpy(&v, p, 8); return v; }
inline uint32_t xxh_read32(const uint8_t * p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
inline uint64_t xxh_round(uint64_t acc, uint64_t in) { return xxh_rotl(acc + in*XXH_P2, 31)*XXH_P1; }
inline uint64_t xxh_merge(uint64_t acc, uint64_t v) { return (acc ^ xxh_round(0, v))*XXH_P1 + XXH_P4; }

uint64_t xxh64(const void * data, size_t len, uint64_t seed) {
    const uint8_t * p   = (const uint8_t *) data;
    const uint8_t * end = p + len;
    uint64_t h;
    if (len >= 32) {
        uint64_t v1 = seed + XXH_P1 + XXH_P2, v2 = seed + XXH_P2, v3 = seed, v4 = seed - XXH_P1;
        for (; p + 32 <= end; p += 32) {
            v1 = xxh_round(v1, xxh_read64(p));
            v2 = xxh_round(v2, xxh_read64(p + 8));
            v3 = xxh_round(v3, xxh_read64(p + 16));
            v4 = xxh_round(v4, xxh_read64(p + 24));
        }
        h = xxh_rotl(v1, 1) + xxh_rotl(v2, 7) + xxh_rotl(v3, 12) + xxh_rotl(v4, 18);
        h = xxh_merge(xxh_merge(xxh_merge(xxh_merge(h, v1), v2), v3), v4);
    } else {
        h = seed + XXH_P5;
    }
    h += len;
    for (; p + 8 <= end; p += 8) {
        h = xxh_rotl(h ^ xxh_round(0, xxh_read64(p)), 27)*XXH_P1 + XXH_P4;
    }
    if (p + 4 <= end) {
        h = xxh_rotl(h ^ (xxh_read32(p)*XXH_P1), 23)*XXH_P2 + XXH_P3;
        p += 4;
    }
    for (; p < end; ++p) {
        h = xxh_rotl(h ^ (*p*XXH_P5), 11)*XXH_P1;
    }
    h ^= h >> 33; h *= XXH_P2;
    h ^= h >> 29; h *= XXH_P3;
    h ^= h >> 32;
    return h;
}

uint64_t xxh64(const std::string & s) {
    return xxh64(s.data(), s.size(), 0);
}

// CRC-32 as zlib computes it (a test rewrites a file's key and its CRC with Python's zlib.crc32)
uint32_t crc32(const uint8_t * p, size_t n) {
    static const auto table = [] {
        std::array<uint32_t, 256> t{};
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) {
                c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            }
            t[i] = c;
        }
        return t;
    }();
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; ++i) {
        c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    }
    return c ^ 0xFFFFFFFFu;
}

std::string hex64(uint64_t v) {
    char buf[17];
    snprintf(buf, sizeof(buf), "%016llx", (unsigned long long) v);
    return buf;
}

// A model file as the loader opened it: its path, and what identifies it, so that the bytes
// digested at calibration are the loaded ones (a file replaced in between gives no cache)
struct source_file {
    std::string path;
    uint64_t dev = 0, ino = 0, size = 0;
    int64_t  mtime_ns = 0;
};

struct model_source {
    std::vector<source_file> files; // empty: no cache (why_not says why)
    std::string why_not;
    std::string overrides;          // the kv_overrides that the calibration depends on, as text
};

// the models' sources, taken at load (llama_turboq_load_k_center), used by the first calibration;
// keyed by address: every load writes its model's entry, so a model loaded where a freed one was
// never sees the other's
std::mutex g_sources_mutex;
std::map<const llama_model *, model_source> g_sources;

#if defined(__linux__) || defined(__APPLE__)
#define TQ_KCAL_CACHE 1

bool stat_file(int fd, source_file & f) {
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        return false;
    }
    f.dev  = (uint64_t) st.st_dev;
    f.ino  = (uint64_t) st.st_ino;
    f.size = (uint64_t) st.st_size;
#if defined(__APPLE__)
    f.mtime_ns = (int64_t) st.st_mtimespec.tv_sec*1000000000 + st.st_mtimespec.tv_nsec;
#else
    f.mtime_ns = (int64_t) st.st_mtim.tv_sec*1000000000 + st.st_mtim.tv_nsec;
#endif
    return true;
}

// the path of an open file (the loader keeps the descriptor, not the name)
bool fd_path(int fd, std::string & path) {
#if defined(__APPLE__)
    char buf[PATH_MAX];
    if (fcntl(fd, F_GETPATH, buf) == -1) {
        return false;
    }
    path = buf;
#else
    std::vector<char> buf(4096);
    const std::string link = "/proc/self/fd/" + std::to_string(fd);
    const ssize_t n = readlink(link.c_str(), buf.data(), buf.size() - 1);
    if (n <= 0 || (size_t) n >= buf.size() - 1 || buf[0] != '/') {
        return false;
    }
    path.assign(buf.data(), (size_t) n);
#endif
    return true;
}

// Digest of one file's bytes: the XXH64 of each 64 MiB piece (seeded with its index), read through
// a private mapping, the pieces spread over n_threads; then the XXH64 of the pieces' digests and the
// size. The file was just loaded, so its pages are mostly in memory: measured on the 2-core machine
// (page cache warm), 0.19-0.24 s per GB with one thread or two (a second thread did not help there:
// the page faults, not XXH64, bound it); a file that is not in memory costs its read from disk.
// The file must still be the one the loader opened (same device, inode, size, mtime).
bool file_digest(const source_file & f, int n_threads, uint64_t & out, std::string & why) {
    const int fd = open(f.path.c_str(), O_RDONLY);
    if (fd < 0) {
        why = "cannot open the model file " + f.path + ": " + std::strerror(errno);
        return false;
    }
    source_file now;
    if (!stat_file(fd, now) || now.dev != f.dev || now.ino != f.ino || now.size != f.size || now.mtime_ns != f.mtime_ns) {
        close(fd);
        why = "the model file " + f.path + " changed since it was loaded";
        return false;
    }
    constexpr size_t PIECE = size_t(64) << 20;
    const size_t size     = (size_t) f.size;
    const size_t n_pieces = (size + PIECE - 1)/PIECE;
    std::vector<uint64_t> pieces(n_pieces + 1, 0);
    pieces[n_pieces] = (uint64_t) size;
    if (size > 0) {
        void * map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            close(fd);
            why = "cannot map the model file " + f.path + ": " + std::strerror(errno);
            return false;
        }
        madvise(map, size, MADV_SEQUENTIAL);
        const auto * base = (const uint8_t *) map;
        std::atomic<size_t> next{0};
        auto work = [&]() {
            for (size_t i; (i = next++) < n_pieces; ) {
                pieces[i] = xxh64(base + i*PIECE, std::min(PIECE, size - i*PIECE), i);
            }
        };
        const size_t n_workers = std::max<size_t>(1, std::min<size_t>((size_t) std::max(n_threads, 1), n_pieces));
        std::vector<std::thread> workers;
        try {
            for (size_t t = 1; t < n_workers; ++t) {
                workers.emplace_back(work);
            }
        } catch (const std::system_error &) {
            // fewer threads: the ones that run take the other pieces
        }
        work();
        for (auto & w : workers) {
            w.join();
        }
        munmap(map, size);
    }
    close(fd);
    out = xxh64(pieces.data(), pieces.size()*sizeof(uint64_t), 0);
    return true;
}

// "<file name> <size> <mtime>" of the library (or executable) that holds addr
std::string library_of(const void * addr) {
    Dl_info info;
    if (addr == nullptr || dladdr(addr, &info) == 0 || info.dli_fname == nullptr) {
        return "?";
    }
    struct stat st;
    if (stat(info.dli_fname, &st) != 0) {
        return std::string(info.dli_fname) + " ?";
    }
    std::string name = info.dli_fname;
    name = name.substr(name.find_last_of('/') + 1);
#if defined(__APPLE__)
    const int64_t mtime = (int64_t) st.st_mtimespec.tv_sec*1000000000 + st.st_mtimespec.tv_nsec;
#else
    const int64_t mtime = (int64_t) st.st_mtim.tv_sec*1000000000 + st.st_mtim.tv_nsec;
#endif
    return name + " " + std::to_string((long long) st.st_size) + " " + std::to_string((long long) mtime);
}

void environment_of(const char * prefix, std::vector<std::string> & out) {
    for (char ** e = TQ_ENVIRON; e && *e; ++e) {
        if (std::strncmp(*e, prefix, std::strlen(prefix)) == 0) {
            out.emplace_back(*e);
        }
    }
}
#endif // __linux__ || __APPLE__

// the model's files and overrides, at load (the loader is gone when the calibration runs)
model_source source_of(const llama_model_loader & ml) {
    model_source src;
    // every kv_override but pyturbo's turboq.* keys (see the key above), in one order
    std::vector<std::string> ov;
    for (const auto & [key, o] : ml.kv_overrides) {
        if (key.rfind("turboq.", 0) == 0) {
            continue;
        }
        char val[160];
        switch (o.tag) {
            case LLAMA_KV_OVERRIDE_TYPE_INT:   snprintf(val, sizeof(val), "i%lld", (long long) o.val_i64); break;
            case LLAMA_KV_OVERRIDE_TYPE_FLOAT: snprintf(val, sizeof(val), "f%a", o.val_f64); break;
            case LLAMA_KV_OVERRIDE_TYPE_BOOL:  snprintf(val, sizeof(val), "b%d", (int) o.val_bool); break;
            case LLAMA_KV_OVERRIDE_TYPE_STR:   snprintf(val, sizeof(val), "s%.128s", o.val_str); break;
            default:                           snprintf(val, sizeof(val), "?%d", (int) o.tag); break;
        }
        ov.push_back(key + "=" + val);
    }
    std::sort(ov.begin(), ov.end());
    for (const auto & s : ov) {
        src.overrides += s + ";";
    }
#ifdef TQ_KCAL_CACHE
    if (ml.files.empty()) {
        src.why_not = "the model was not loaded from a file";
    }
    for (const auto & file : ml.files) {
        source_file f;
        const int fd = file->file_id();
        if (fd < 0 || !stat_file(fd, f) || !fd_path(fd, f.path)) {
            src.files.clear();
            src.why_not = "the model file's path is not known";
            break;
        }
        src.files.push_back(std::move(f));
    }
#else
    src.why_not = "not on this platform";
#endif
    return src;
}

// the cache directory, as pyturbo/_paths.py's cache_dir() finds it; empty when none can be named
std::string cache_dir() {
    auto env = [](const char * v) -> std::string { return v && *v ? v : ""; };
    std::string base = env(std::getenv("PYTURBO_CACHE"));
    if (base.empty()) {
        std::string xdg = env(std::getenv("XDG_CACHE_HOME"));
        if (xdg.empty()) {
            const std::string home = env(std::getenv("HOME"));
            if (home.empty()) {
                return "";
            }
            xdg = home + "/.cache";
        }
        base = xdg + "/pyturbo";
    }
    return base + "/k-calibration";
}

#ifdef TQ_KCAL_CACHE
// The key (see above), one "name=value" line each; model_digest: the files' digest
bool key_text(const llama_model & model, const llama_context_params & params, const model_source & src,
              std::string & key, uint64_t & model_digest, std::string & why) {
    std::vector<uint64_t> digests;
    for (const auto & f : src.files) {
        uint64_t d = 0;
        if (!file_digest(f, (int) std::max(params.n_threads, params.n_threads_batch), d, why)) {
            return false;
        }
        digests.push_back(d);
    }
    model_digest = xxh64(digests.data(), digests.size()*sizeof(uint64_t), 0);

    std::string k;
    auto line = [&k](const std::string & name, const std::string & value) {
        std::string v = value;
        std::replace(v.begin(), v.end(), '\n', ' ');
        k += name + "=" + v + "\n";
    };
    line("calibration", std::to_string(CALIBRATION_VERSION));
    line("text", hex64(xxh64(CALIBRATION_TEXT)) + " " + std::to_string(CALIBRATION_TOKENS) + " tokens");
    line("balance", k_balancing() ? "1" : "0");
    {
        std::string files;
        for (size_t i = 0; i < src.files.size(); ++i) {
            files += (i ? " " : "") + hex64(digests[i]) + ":" + std::to_string(src.files[i].size);
        }
        line("model", files);
    }
    line("overrides", src.overrides.empty() ? "none" : hex64(xxh64(src.overrides)));
    {
        const float * s1 = nullptr;
        const float * s2 = nullptr;
        ggml_turboq_signs(&s1, &s2);
        const char * seed = ggml_turboq_sign_seed();
        line("signs", hex64(xxh64(s1, 128*sizeof(float), 0) ^ xxh64(s2, 128*sizeof(float), 1)) +
                      (seed ? std::string(" seed ") + seed : std::string(" shipped")));
    }
    {
        const uint32_t one = 1;
        uint8_t first;
        std::memcpy(&first, &one, 1);
        line("endian", first == 1 ? "little" : "big");
    }
    {
        std::string devs;
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            ggml_backend_dev_t dev = ggml_backend_dev_get(i);
            devs += std::string(i ? "; " : "") + ggml_backend_dev_name(dev) + " (" + ggml_backend_dev_description(dev) + ")";
        }
        line("devices", devs);
        std::string used;
        for (const auto & d : model.devices) {
            used += std::string(used.empty() ? "" : " ") + (d.is_meta ? "meta:" : "") + ggml_backend_dev_name(d.dev);
        }
        line("model_devices", used.empty() ? "none" : used);
    }
    {
        std::string feats;
        std::string libs = library_of((const void *) &llama_turboq_calibrate_k_means) + "; " +
                           library_of((const void *) &ggml_init);
        for (size_t i = 0; i < ggml_backend_reg_count(); ++i) {
            ggml_backend_reg_t reg = ggml_backend_reg_get(i);
            libs += "; " + library_of((const void *) reg);
            auto * get_features = (ggml_backend_get_features_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_get_features");
            if (get_features) {
                feats += std::string(feats.empty() ? "" : "; ") + ggml_backend_reg_name(reg) + ":";
                for (ggml_backend_feature * f = get_features(reg); f && f->name; ++f) {
                    feats += std::string(" ") + f->name + "=" + f->value;
                }
            }
        }
        line("features", feats);
        line("libraries", libs);
    }
    {
        // where each weight lives: counts per buffer type, and a digest of the whole placement
        std::map<std::string, int> count;
        std::string placement;
        for (const auto & [name, t] : model.tensors_by_name) {
            const char * buft = t->buffer ? ggml_backend_buft_name(ggml_backend_buffer_get_type(t->buffer)) : "none";
            count[buft]++;
            placement += name + "@" + buft + ";";
        }
        std::string summary;
        for (const auto & [buft, n] : count) {
            summary += buft + std::string(" ") + std::to_string(n) + ", ";
        }
        line("weights", summary + hex64(xxh64(placement)));
    }
    line("offload", std::string("kqv ") + (params.offload_kqv ? "1" : "0") + " op " + (params.op_offload ? "1" : "0"));
    {
        std::vector<std::string> env;
        environment_of("GGML_", env);
        std::sort(env.begin(), env.end());
        std::string all;
        for (const auto & e : env) {
            all += e + ";";
        }
        line("ggml_env", env.empty() ? "none" : hex64(xxh64(all)));
    }
    key = std::move(k);
    return true;
}
#else
bool key_text(const llama_model &, const llama_context_params &, const model_source &, std::string &, uint64_t &,
              std::string & why) {
    why = "not on this platform";
    return false;
}
#endif

// key_text, where a failure (no thread to start, no memory) is no cache rather than a failed context
bool key_text_safe(const llama_model & model, const llama_context_params & params, const model_source & src,
                   std::string & key, uint64_t & model_digest, std::string & why) {
    try {
        return key_text(model, params, src, key, model_digest, why);
    } catch (const std::exception & e) {
        why = e.what();
        key.clear();
        return false;
    }
}

// the first line where two keys differ, as "name: stored X, now Y" (values cut short)
std::string key_difference(const std::string & stored, const std::string & now) {
    auto lines = [](const std::string & s) {
        std::vector<std::string> out;
        size_t i = 0;
        while (i < s.size()) {
            const size_t j = s.find('\n', i);
            out.push_back(s.substr(i, j == std::string::npos ? std::string::npos : j - i));
            i = j == std::string::npos ? s.size() : j + 1;
        }
        return out;
    };
    const auto a = lines(stored), b = lines(now);
    auto cut = [](const std::string & v) { return v.size() > 72 ? v.substr(0, 69) + "..." : v; };
    for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
        const std::string x = i < a.size() ? a[i] : "", y = i < b.size() ? b[i] : "";
        if (x != y) {
            const size_t eq = (x.empty() ? y : x).find('=');
            const std::string name = (x.empty() ? y : x).substr(0, eq);
            const std::string xv = eq == std::string::npos || x.empty() ? "(none)" : x.substr(eq + 1);
            const std::string yv = eq == std::string::npos || y.empty() ? "(none)" : y.substr(eq + 1);
            return name + ": " + cut(xv) + " there, " + cut(yv) + " here";
        }
    }
    return "?";
}

// the cached statistics at path, if the file is whole and holds this key; else false and why
bool read_cache(const std::string & path, const std::string & key, uint32_t n_layer,
                std::vector<std::vector<float>> & out, std::string & why) {
    FILE * fp = ggml_fopen(path.c_str(), "rb");
    if (!fp) {
        why = errno == ENOENT ? "not in the cache" : std::string("cannot read ") + path + ": " + std::strerror(errno);
        return false;
    }
    std::vector<uint8_t> buf;
    uint8_t chunk[1 << 16];
    size_t got;
    while ((got = fread(chunk, 1, sizeof(chunk), fp)) > 0 && buf.size() <= CACHE_MAX_BYTES) {
        buf.insert(buf.end(), chunk, chunk + got);
    }
    const bool err = ferror(fp) != 0;
    fclose(fp);
    if (err) {
        why = "cannot read " + path;
        return false;
    }
    size_t at = 0;
    auto take = [&](void * dst, size_t n) {
        if (buf.size() - at < n) {
            return false;
        }
        std::memcpy(dst, buf.data() + at, n);
        at += n;
        return true;
    };
    char magic[8];
    uint32_t format = 0, key_len = 0;
    if (!take(magic, 8) || std::memcmp(magic, CACHE_MAGIC, 8) != 0) {
        why = "the cached file " + path + " is not a calibration file";
        return false;
    }
    if (buf.size() < 12 + 4 || crc32(buf.data(), buf.size() - 4) != xxh_read32(buf.data() + buf.size() - 4)) {
        why = "the cached file " + path + " is corrupt or short (its CRC-32 does not match)";
        return false;
    }
    if (!take(&format, 4) || format != CACHE_FORMAT) {
        why = "the cached file " + path + " has format " + std::to_string(format) + ", this build reads " + std::to_string(CACHE_FORMAT);
        return false;
    }
    if (!take(&key_len, 4) || key_len > buf.size() - at) {
        why = "the cached file " + path + " is corrupt (its key is longer than the file)";
        return false;
    }
    const std::string stored((const char *) buf.data() + at, key_len);
    at += key_len;
    if (stored != key) {
        why = "the cached file " + path + " is of another calibration (" + key_difference(stored, key) + ")";
        return false;
    }
    uint32_t n = 0;
    if (!take(&n, 4) || n != n_layer) {
        why = "the cached file " + path + " has " + std::to_string(n) + " layers, the model " + std::to_string(n_layer);
        return false;
    }
    std::vector<uint32_t> sizes(n);
    size_t total = 0;
    for (auto & s : sizes) {
        if (!take(&s, 4) || s % K_N_STATS != 0) {
            why = "the cached file " + path + " is corrupt (a layer's size)";
            return false;
        }
        total += s;
    }
    if (buf.size() - at != total*sizeof(float) + 4) {
        why = "the cached file " + path + " is corrupt (its size does not match its layers)";
        return false;
    }
    std::vector<std::vector<float>> stats(n);
    for (uint32_t il = 0; il < n; ++il) {
        stats[il].resize(sizes[il]);
        take(stats[il].data(), sizes[il]*sizeof(float));
    }
    out = std::move(stats);
    return true;
}

// Removes what no load will read again: files of keys not used for CACHE_KEEP (a read touches its
// file; another build's files, those of an RPC server's former port, ...), and temporary files of
// writers that died. Run when a file is written, so a cache that is only read never changes.
void prune_cache(const std::string & dir) {
    namespace fs = std::filesystem;
    std::error_code ec;
    const auto now = fs::file_time_type::clock::now();
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
        const std::string name = it->path().filename().string();
        const bool tmp  = name.find(".kcal.tmp-") != std::string::npos;
        const bool kcal = !tmp && name.size() > 5 && name.compare(name.size() - 5, 5, ".kcal") == 0;
        std::error_code e;
        const auto t = fs::last_write_time(it->path(), e);
        if (!e && (kcal || tmp) && now - t > (kcal ? CACHE_KEEP : CACHE_KEEP_TMP)) {
            fs::remove(it->path(), e);
        }
    }
}

// writes the statistics under path (a temporary file, then a rename); false and why when it cannot
bool write_cache(const std::string & dir, const std::string & path, const std::string & key,
                 const std::vector<std::vector<float>> & stats, std::string & why) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) {
        why = "cannot create " + dir + ": " + ec.message();
        return false;
    }
    std::vector<uint8_t> buf;
    auto put = [&buf](const void * src, size_t n) {
        buf.insert(buf.end(), (const uint8_t *) src, (const uint8_t *) src + n);
    };
    const uint32_t key_len = (uint32_t) key.size();
    const uint32_t n_layer = (uint32_t) stats.size();
    put(CACHE_MAGIC, 8);
    put(&CACHE_FORMAT, 4);
    put(&key_len, 4);
    put(key.data(), key.size());
    put(&n_layer, 4);
    for (const auto & s : stats) {
        const uint32_t n = (uint32_t) s.size();
        put(&n, 4);
    }
    for (const auto & s : stats) {
        put(s.data(), s.size()*sizeof(float));
    }
    const uint32_t crc = crc32(buf.data(), buf.size());
    put(&crc, 4);

    // a name no other writer uses: the process and thread, and the time
    const uint64_t tag = xxh64(std::to_string(ggml_time_us()) + "/" +
                               std::to_string(std::hash<std::thread::id>()(std::this_thread::get_id())) + "/" +
                               std::to_string((uintptr_t) &stats));
#ifdef TQ_KCAL_CACHE
    const std::string tmp = path + ".tmp-" + std::to_string((long long) getpid()) + "-" + hex64(tag);
#else
    const std::string tmp = path + ".tmp-" + hex64(tag);
#endif
    FILE * fp = ggml_fopen(tmp.c_str(), "wb");
    if (!fp) {
        why = "cannot write " + tmp + ": " + std::strerror(errno);
        return false;
    }
    const bool written = fwrite(buf.data(), 1, buf.size(), fp) == buf.size();
    const bool closed  = fclose(fp) == 0;
    if (!written || !closed) {
        why = "cannot write " + tmp + ": " + std::strerror(errno);
        std::filesystem::remove(tmp, ec);
        return false;
    }
    std::filesystem::rename(tmp, path, ec);
    if (ec) {
        why = "cannot rename " + tmp + " to " + path + ": " + ec.message();
        std::filesystem::remove(tmp, ec);
        return false;
    }
    prune_cache(dir);
    return true;
}

} // namespace

const char * llama_turboq_k_center_key(void) {
    return "turboq.k_center";
}

void llama_turboq_load_k_center(const llama_model_loader & ml, llama_model & model) {
    const char * key = llama_turboq_k_center_key();
    bool on = true;
    const char * from = nullptr;
    const auto it = ml.kv_overrides.find(key);
    if (it != ml.kv_overrides.end()) {
        // a bool, or an int 0/1 (what an --override-kv of int: or a binding without bools sends)
        if (it->second.tag == LLAMA_KV_OVERRIDE_TYPE_BOOL) {
            on = it->second.val_bool;
        } else if (it->second.tag == LLAMA_KV_OVERRIDE_TYPE_INT && (it->second.val_i64 == 0 || it->second.val_i64 == 1)) {
            on = it->second.val_i64 == 1;
        } else {
            throw std::runtime_error(std::string(key) + ": the override must be a bool (or an int, 0 or 1)");
        }
        from = "set by --kv-k-center, LLAMA_ARG_KV_K_CENTER or kv_overrides";
    } else if (const int64_t id = gguf_find_key(ml.metadata, key); id >= 0) {
        if (gguf_get_kv_type(ml.metadata, id) != GGUF_TYPE_BOOL) {
            throw std::runtime_error(std::string(key) + " in the GGUF must be a bool");
        }
        on = gguf_get_val_bool(ml.metadata, id);
        from = "from the GGUF";
    }
    model.turboq_k_center = on;

    // the calibration cache's source (the loader, with the files, is gone when the calibration runs)
    {
        model_source src = on ? source_of(ml) : model_source();
        std::lock_guard<std::mutex> lk(g_sources_mutex);
        if (on) {
            g_sources[&model] = std::move(src);
        } else {
            g_sources.erase(&model);
        }
    }
    if (!on) {
        LLAMA_LOG_INFO("%s: %s=false (%s): a turboq K cache is stored without centering or channel scale\n",
                       __func__, key, from);
    }
}

bool llama_turboq_k_centering(const llama_model & model, ggml_type type_k) {
    return ggml_turboq_group(type_k) && model.turboq_k_center;
}

void llama_turboq_calibrate_k_means(llama_model & model, const llama_context_params & params) {
    if (llama_turboq_calibrating() || !llama_turboq_k_centering(model, params.type_k) || model.hparams.no_alloc || model.hparams.is_mla()) {
        return;
    }
    std::lock_guard<std::mutex> lock(g_calibration_mutex);
    if (model.turboq_k_mean_done) {
        return;
    }
    const int64_t t0 = ggml_time_us();

    // the model's files, taken at load; needed once
    model_source src;
    {
        std::lock_guard<std::mutex> lk(g_sources_mutex);
        const auto it = g_sources.find(&model);
        if (it != g_sources.end()) {
            src = std::move(it->second);
            g_sources.erase(it);
        } else {
            src.why_not = "the model's file is not known";
        }
    }

    // the cached statistics, when this model and build have a file (see "the calibration cache")
    const uint32_t n_layer = model.hparams.n_layer();
    std::string path;
    std::string key;
    std::string cache_why;
    const std::string dir = cache_dir();
    uint64_t model_digest = 0;
    if (src.files.empty()) {
        cache_why = "no cache: " + src.why_not;
    } else if (dir.empty()) {
        cache_why = "no cache: PYTURBO_CACHE, XDG_CACHE_HOME and HOME are unset or empty";
    } else if (!key_text_safe(model, params, src, key, model_digest, cache_why)) {
        cache_why = "no cache: " + cache_why;
    } else {
        path = dir + "/" + hex64(model_digest) + "-" + hex64(xxh64(key)) + ".kcal";
    }
    // the key's cost (the model file's digest, nearly all of it), where one was made
    char digest_ms[64] = "";
    if (!key.empty()) {
        snprintf(digest_ms, sizeof(digest_ms), " (the model file's digest: %.0f ms)", (ggml_time_us() - t0)/1000.0);
    }

    auto counts = [&model](int & n_layers, int & n_scaled) {
        // a layer without a post-RoPE "Qcur-<il>" in the graph keeps s = 1 (centering only)
        n_layers = n_scaled = 0;
        for (const auto & m : model.turboq_k_mean) {
            n_layers += !m.empty();
            n_scaled += !m.empty() && std::any_of(m.begin() + Q_ENERGY*(m.size()/K_N_STATS), m.end(), [](float x) { return x != 0.0f; });
        }
    };
    int n_layers = 0;
    int n_scaled = 0;

    std::vector<std::vector<float>> stats;
    bool read = false;
    if (!path.empty()) {
        try {
            read = read_cache(path, key, n_layer, stats, cache_why);
        } catch (const std::exception & e) {
            cache_why = std::string("cannot read ") + path + ": " + e.what();
        }
    }
    if (read) {
        // used: kept by prune_cache (a cache that cannot be written keeps its files anyway)
        std::error_code ec;
        std::filesystem::last_write_time(path, std::filesystem::file_time_type::clock::now(), ec);
        model.turboq_k_mean = std::move(stats);
        model.turboq_k_mean_done = true;
        counts(n_layers, n_scaled);
        LLAMA_LOG_INFO("%s: K means calibrated for %d layers, channel scales for %d: read from %s in %.0f ms%s\n", __func__,
                       n_layers, n_scaled, path.c_str(), (ggml_time_us() - t0)/1000.0, digest_ms);
        return;
    }

    log_filter filter;
    llama_log_get(&filter.cb, &filter.user_data);
    llama_log_set(log_filtered, &filter);
    llama_turboq_set_calibrating(true);
    std::string why;
    bool ok = false;
    try {
        ok = run_calibration(model, params, why);
    } catch (const std::exception & e) {
        why = e.what();
    }
    llama_turboq_set_calibrating(false);
    llama_log_set(filter.cb, filter.user_data);

    model.turboq_k_mean_done = true;
    if (ok) {
        std::string saved;
        if (!path.empty()) {
            std::string write_why;
            bool written = false;
            try {
                written = write_cache(dir, path, key, model.turboq_k_mean, write_why);
            } catch (const std::exception & e) {
                write_why = e.what();
            }
            saved = written ? "; saved to " + path : "; not saved: " + write_why;
        }
        counts(n_layers, n_scaled);
        LLAMA_LOG_INFO("%s: K means calibrated for %d layers, channel scales for %d, in %.0f ms%s: computed (%s)%s\n", __func__,
                       n_layers, n_scaled, (ggml_time_us() - t0)/1000.0, digest_ms, cache_why.c_str(), saved.c_str());
    } else {
        model.turboq_k_mean.clear();
        LLAMA_LOG_WARN("%s: K centering is off for this model: %s\n", __func__, why.c_str());
    }
}

ggml_tensor * llama_turboq_new_k_mean(ggml_context * ctx, int64_t n_embd_k_gqa, const char * tag, uint32_t il) {
    ggml_tensor * t = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 2*n_embd_k_gqa);
    ggml_format_name(t, "cache_%sk_mean_l%d", tag, il);
    return t;
}

void llama_turboq_load_k_mean(const llama_model & model, ggml_tensor * k_mean, uint32_t il, uint32_t span) {
    const size_t n = (size_t) ggml_nelements(k_mean);
    if (il < model.turboq_k_mean.size() && model.turboq_k_mean[il].size() == K_N_STATS*(n/2)) {
        const std::vector<float> ms = k_mean_for(model, il, model.turboq_k_mean[il], span);
        ggml_backend_tensor_set(k_mean, ms.data(), 0, n*sizeof(float));
    } else {
        // no centering: mu = 0, s = 1
        std::vector<float> id(n, 0.0f);
        std::fill(id.begin() + n/2, id.end(), 1.0f);
        ggml_backend_tensor_set(k_mean, id.data(), 0, n*sizeof(float));
    }
}

void llama_turboq_set_k_span(llama_memory_i * mem, uint32_t n_pos) {
    if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        kv->turboq_set_k_span(n_pos);
    } else if (auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        // the sliding-window cache holds a window, but at the sequence's positions
        iswa->get_base()->turboq_set_k_span(n_pos);
        iswa->get_swa()->turboq_set_k_span(n_pos);
    } else if (auto * hyb = dynamic_cast<llama_memory_hybrid *>(mem)) {
        hyb->get_mem_attn()->turboq_set_k_span(n_pos);
    } else if (auto * hyb_iswa = dynamic_cast<llama_memory_hybrid_iswa *>(mem)) {
        llama_turboq_set_k_span(hyb_iswa->get_mem_attn(), n_pos);
    }
}

static ggml_tensor * k_part(ggml_context * ctx, ggml_tensor * k_mean, int part) {
    const int64_t n = ggml_nelements(k_mean)/2;
    return ggml_view_1d(ctx, k_mean, n, part*n*ggml_element_size(k_mean));
}

ggml_tensor * llama_turboq_center_k(ggml_context * ctx, ggml_tensor * k_cur, ggml_tensor * k_mean) {
    GGML_ASSERT(2*k_cur->ne[0] == k_mean->ne[0]);
    return ggml_mul(ctx, ggml_sub(ctx, k_cur, k_part(ctx, k_mean, 0)), k_part(ctx, k_mean, 1));
}

ggml_tensor * llama_turboq_scale_q(ggml_context * ctx, ggml_tensor * q_cur, ggml_tensor * k_mean) {
    // q [n_embd_head, n_head, n_tokens] as [n_embd_head, gqa, n_head_kv, n_tokens]: query head h reads KV head h/gqa
    const int64_t d    = q_cur->ne[0];
    const int64_t n_kv = ggml_nelements(k_mean)/2/d;
    GGML_ASSERT(n_kv > 0 && q_cur->ne[1] % n_kv == 0 && q_cur->ne[3] == 1);
    if (!ggml_is_contiguous(q_cur)) {
        q_cur = ggml_cont(ctx, q_cur);
    }
    const int64_t gqa = q_cur->ne[1]/n_kv;
    ggml_tensor * q4 = ggml_reshape_4d(ctx, q_cur, d, gqa, n_kv, q_cur->ne[2]);
    ggml_tensor * s4 = ggml_reshape_4d(ctx, k_part(ctx, k_mean, 1), d, 1, n_kv, 1);
    return ggml_reshape_3d(ctx, ggml_div(ctx, q4, s4), d, q_cur->ne[1], q_cur->ne[2]);
}

ggml_tensor * llama_turboq_k_mean_heads(ggml_context * ctx, ggml_tensor * k_mean, int64_t n_cols, int64_t n_head_kv,
                                        int64_t n_embd_head, int64_t offset, int part) {
    const size_t es = ggml_element_size(k_mean);
    const int64_t base = part*(ggml_nelements(k_mean)/2);
    return ggml_view_3d(ctx, k_mean, n_cols, n_head_kv, 1, n_embd_head*es, n_embd_head*n_head_kv*es, (base + offset)*es);
}

void llama_turboq_write_k_mean(llama_io_write_i & io, ggml_tensor * k_mean) {
    const uint32_t magic = K_MEAN_MAGIC;
    const uint32_t n = (uint32_t) ggml_nelements(k_mean);
    io.write(&magic, sizeof(magic));
    io.write(&n, sizeof(n));
    io.write_tensor(k_mean, 0, ggml_nbytes(k_mean));
}

bool llama_turboq_read_k_mean(llama_io_read_i & io, ggml_tensor * k_mean, uint32_t il) {
    uint32_t magic = 0;
    uint32_t n = 0;
    io.read(&magic, sizeof(magic));
    if (magic == K_MEAN_MAGIC_NOSC) {
        LLAMA_LOG_ERROR("%s: layer %u: the state was saved by an earlier build, whose K cache had no channel scale; "
                        "it cannot be restored exactly (process the prompt again)\n", __func__, il);
        return false;
    }
    if (magic == K_MEAN_MAGIC_OLD) {
        LLAMA_LOG_ERROR("%s: layer %u: the state was saved by an earlier build, whose K-centering mean came from the "
                        "first request; it cannot be restored exactly (process the prompt again)\n", __func__, il);
        return false;
    }
    if (magic == K_MEAN_MAGIC_SEED) {
        LLAMA_LOG_ERROR("%s: layer %u: the state was saved under the former TURBOQ_SIGN_SEED switch, with rotation signs "
                        "that this build may not have; it cannot be restored (process the prompt again)\n", __func__, il);
        return false;
    }
    if (magic != K_MEAN_MAGIC) {
        LLAMA_LOG_ERROR("%s: layer %u: the state has no K-centering mean for this turboq K cache "
                        "(saved without K centering, e.g. with turboq.k_center=false, or corrupt)\n", __func__, il);
        return false;
    }
    io.read(&n, sizeof(n));
    if (n != (uint32_t) ggml_nelements(k_mean)) {
        LLAMA_LOG_ERROR("%s: layer %u: K-centering mean has %u values, the cache needs %lld\n", __func__, il, n, (long long) ggml_nelements(k_mean));
        return false;
    }
    std::vector<float> saved(n);
    std::vector<float> cur(n);
    io.read(saved.data(), n*sizeof(float));
    for (float x : saved) {
        if (!std::isfinite(x)) {
            LLAMA_LOG_ERROR("%s: layer %u: the saved K-centering mean is not finite (corrupt state)\n", __func__, il);
            return false;
        }
    }
    ggml_backend_tensor_get(k_mean, cur.data(), 0, n*sizeof(float));
    if (std::memcmp(saved.data(), cur.data(), n*sizeof(float)) != 0) {
        LLAMA_LOG_ERROR("%s: layer %u: the state's K-centering mean or channel scale is not this cache's (saved from another model "
                        "file, backend or build, by a context of another size, or corrupt); its K rows would be read wrong\n", __func__, il);
        return false;
    }
    return true;
}
