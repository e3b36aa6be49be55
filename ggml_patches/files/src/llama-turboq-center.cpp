#include "llama-turboq-center.h"
#include "llama-turboq.h"

#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"
#include "llama-context.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-hybrid-iswa.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>
#include <stdexcept>
#include <string>

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

std::string calibration_text() {
    const char * path = std::getenv("TURBOQ_K_CALIB_TEXT"); // debug: calibrate on another text
    if (path == nullptr) {
        return CALIBRATION_TEXT;
    }
    std::string text;
    if (FILE * f = std::fopen(path, "rb")) {
        char buf[4096];
        size_t n;
        while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) {
            text.append(buf, n);
        }
        std::fclose(f);
    }
    return text;
}

std::vector<llama_token> calibration_tokens(const llama_vocab * vocab, int n) {
    const std::string text = calibration_text();
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

// the span override (debug): TURBOQ_K_MEAN_SPAN=N fits the mean to N positions, 0 keeps the
// calibration's own; -1 when unset
int64_t k_span_override() {
    const char * env = std::getenv("TURBOQ_K_MEAN_SPAN");
    return env ? std::max(0, std::atoi(env)) : -1;
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
    const int64_t over = k_span_override();
    span = over >= 0 ? over : span;
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
    const char * env = std::getenv("TURBOQ_K_CALIB_TOKENS"); // debug: the calibration length
    const int n_want = env ? std::max(1, std::atoi(env)) : CALIBRATION_TOKENS;
    const std::vector<llama_token> toks = calibration_tokens(llama_model_get_vocab(&model), n_want);
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

} // namespace

bool llama_turboq_k_centering(ggml_type type_k) {
    if (!ggml_turboq_group(type_k)) {
        return false;
    }
    const char * env = std::getenv("TURBOQ_K_CENTER");
    return env == nullptr || std::strcmp(env, "0") != 0;
}

void llama_turboq_calibrate_k_means(llama_model & model, const llama_context_params & params) {
    if (llama_turboq_calibrating() || !llama_turboq_k_centering(params.type_k) || model.hparams.no_alloc || model.hparams.is_mla()) {
        return;
    }
    std::lock_guard<std::mutex> lock(g_calibration_mutex);
    if (model.turboq_k_mean_done) {
        return;
    }
    const int64_t t0 = ggml_time_us();

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
        // a layer without a post-RoPE "Qcur-<il>" in the graph keeps s = 1 (centering only)
        int n_layers = 0;
        int n_scaled = 0;
        for (const auto & m : model.turboq_k_mean) {
            n_layers += !m.empty();
            n_scaled += !m.empty() && std::any_of(m.begin() + Q_ENERGY*(m.size()/K_N_STATS), m.end(), [](float x) { return x != 0.0f; });
        }
        LLAMA_LOG_INFO("%s: K means calibrated for %d layers, channel scales for %d, in %.0f ms\n", __func__,
                       n_layers, n_scaled, (ggml_time_us() - t0)/1000.0);
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
                        "(saved without K centering, e.g. with TURBOQ_K_CENTER=0, or corrupt)\n", __func__, il);
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
