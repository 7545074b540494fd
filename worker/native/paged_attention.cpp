// Paged attention read in place from the KV pool (CPU, float32).
//
// Every query token ("member": a decode, or one token of a prefill chunk) has a query row, a
// block table and an end: it attends positions [0, end). Members come in groups
// (worker/native/__init__.py, MemberGroups) whose tables start with the same blocks (a cached
// prefix; one prefill chunk's own table): the group's shared positions are read once for the
// query rows of every member, then each run of members with the same table reads the rest.
// GQA: the num_heads / num_kv_heads query heads of a KV head are rows of one work item, so each
// key row is read once for all of them. Work items are (group, KV head) pairs shared among the
// OpenMP threads of the process (torch's own runtime: the library is loaded after torch, whose
// libgomp provides the symbols), so the kernel uses torch's thread count.
//
// Per chunk of at most kChunkKeys positions (chunks start at multiples of kChunkKeys): the
// scores of the rows, one rescale of each row's running max and sum (online softmax),
// exponentials, and the value accumulation. Keys and values are read where they lie in the
// pool: no gather; scratch is one work item's rows (queries, sums, scores: at most
// MAX_GROUP_ROWS x (2 head_dim + 128) floats per thread), whatever the batch or context.
//
// Layout (worker/kv.py): one layer's keys are [kv_heads, pool_blocks,
// block_size, head_dim] contiguous, values likewise; block b of head h starts
// at ((h * pool_blocks + b) * block_size) * head_dim.
//
// Numerics: float32 throughout; exp by Cody-Waite range reduction and a degree-7 polynomial
// (within a few ulp of expf); the result matches a dense softmax attention to float32 rounding
// (tests/worker/test_native_attention.py). Batch-invariant: a row's operations, in order, depend
// only on its query, its end and the keys (chunks aligned to absolute positions; scores, sums and
// products per row in a fixed order whatever block of rows it is computed in), so a token gets
// the same bits as a decode or in any prefill chunk, alone or in any batch: deterministic mode
// runs every token through this kernel.
//
// Vector code uses GCC/Clang vector extensions (8 floats), which the compiler
// maps onto whatever the target has (AVX2 + FMA with -march=native on x86-64,
// two NEON registers on ARM).

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

constexpr int kChunkKeys = 128;   // keys per online-softmax chunk
constexpr int kMaxGroup = 16;     // query heads per KV head supported
constexpr int kMaxHeadDim = 256;  // head_dim supported (a multiple of 8)
constexpr float kEmptyMax = -1e30f;  // running max before any key (finite: no inf - inf)

inline v8f load8(const float* p) {
  v8f r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

inline void store8(float* p, v8f x) { std::memcpy(p, &x, sizeof x); }

inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

inline float hsum(v8f x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// exp(x) for x <= 0 (softmax arguments); 0 below -87 (where expf leaves the normals).
inline v8f exp8(v8f x) {
  const v8f lo = splat(-87.0f);
  v8i tiny = x < lo;
  x = x < lo ? lo : x;
  v8f nf = x * splat(1.44269504088896341f) + splat(0.5f);
  v8i ni = __builtin_convertvector(nf, v8i);  // truncation toward zero
  v8f t = __builtin_convertvector(ni, v8f);
  ni = ni + (t > nf);  // floor: (t > nf) is -1 where truncation rounded up
  t = __builtin_convertvector(ni, v8f);
  v8f r = x - t * splat(0.693145751953125f);
  r = r - t * splat(1.428606765330187045e-06f);
  v8f p = splat(1.0f / 5040.0f);
  p = p * r + splat(1.0f / 720.0f);
  p = p * r + splat(1.0f / 120.0f);
  p = p * r + splat(1.0f / 24.0f);
  p = p * r + splat(1.0f / 6.0f);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  v8i bits = (ni + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof scale);
  v8f out = p * scale;
  return tiny ? splat(0.0f) : out;
}

typedef float v4f __attribute__((vector_size(16)));

// The four sums of x0..x3's lanes, as one 4-vector (a transpose-add: fewer shuffles than 4 hsums).
inline v4f hsum4(v8f x0, v8f x1, v8f x2, v8f x3) {
  v4f y0 = __builtin_shufflevector(x0, x0, 0, 1, 2, 3) + __builtin_shufflevector(x0, x0, 4, 5, 6, 7);
  v4f y1 = __builtin_shufflevector(x1, x1, 0, 1, 2, 3) + __builtin_shufflevector(x1, x1, 4, 5, 6, 7);
  v4f y2 = __builtin_shufflevector(x2, x2, 0, 1, 2, 3) + __builtin_shufflevector(x2, x2, 4, 5, 6, 7);
  v4f y3 = __builtin_shufflevector(x3, x3, 0, 1, 2, 3) + __builtin_shufflevector(x3, x3, 4, 5, 6, 7);
  v4f z0 = __builtin_shufflevector(y0, y1, 0, 4, 1, 5) + __builtin_shufflevector(y0, y1, 2, 6, 3, 7);
  v4f z1 = __builtin_shufflevector(y2, y3, 0, 4, 1, 5) + __builtin_shufflevector(y2, y3, 2, 6, 3, 7);
  return __builtin_shufflevector(z0, z1, 0, 1, 4, 5) + __builtin_shufflevector(z0, z1, 2, 3, 6, 7);
}

// Scores of R (1..3) prescaled query rows (head_dim apart) against `count` key rows: each key
// vector is loaded once for the R rows (4 keys x R rows of accumulators stay in registers).
template <int R>
void score_rows_r(const float* q, int head_dim, const float* keys, int count, float* scores, int score_stride) {
  const int nv = head_dim / 8;
  int t = 0;
  for (; t + 4 <= count; t += 4) {
    const float* k0 = keys + (t + 0) * head_dim;
    v8f acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) acc[r][u] = splat(0.0f);
    for (int i = 0; i < nv; ++i) {
      const v8f x0 = load8(k0 + 8 * i), x1 = load8(k0 + head_dim + 8 * i);
      const v8f x2 = load8(k0 + 2 * head_dim + 8 * i), x3 = load8(k0 + 3 * head_dim + 8 * i);
      for (int r = 0; r < R; ++r) {
        const v8f qv = load8(q + r * head_dim + 8 * i);
        acc[r][0] += qv * x0;
        acc[r][1] += qv * x1;
        acc[r][2] += qv * x2;
        acc[r][3] += qv * x3;
      }
    }
    for (int r = 0; r < R; ++r) {
      const v4f sums = hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      std::memcpy(scores + r * score_stride + t, &sums, sizeof sums);
    }
  }
  for (; t < count; ++t) {
    const float* k0 = keys + t * head_dim;
    for (int r = 0; r < R; ++r) {
      v8f a0 = splat(0.0f);
      for (int i = 0; i < nv; ++i) a0 += load8(q + r * head_dim + 8 * i) * load8(k0 + 8 * i);
      scores[r * score_stride + t] = hsum(a0);
    }
  }
}

// Scores of `group` prescaled queries against `count` key rows, in blocks of up to 3 query rows.
inline void score_rows(const float* q, int group, int head_dim, const float* keys, int count, float* scores,
                       int score_stride) {
  int g = 0;
  for (; g + 3 <= group; g += 3)
    score_rows_r<3>(q + g * head_dim, head_dim, keys, count, scores + g * score_stride, score_stride);
  if (group - g == 2) score_rows_r<2>(q + g * head_dim, head_dim, keys, count, scores + g * score_stride, score_stride);
  if (group - g == 1) score_rows_r<1>(q + g * head_dim, head_dim, keys, count, scores + g * score_stride, score_stride);
}

// acc[r] += sum_t probs[r][t] * values[t] for R (1..4) rows: 2 vectors of the head dim at a
// time for all R rows in registers across the `count` value rows.
template <int R>
void accumulate_rows_r(const float* probs, int prob_stride, int head_dim, const float* values, int count,
                       float* acc) {
  const int nv = head_dim / 8;
  int i = 0;
  for (; i + 2 <= nv; i += 2) {
    v8f a[R][2];
    for (int r = 0; r < R; ++r) {
      a[r][0] = load8(acc + r * head_dim + 8 * i);
      a[r][1] = load8(acc + r * head_dim + 8 * i + 8);
    }
    for (int t = 0; t < count; ++t) {
      const v8f x0 = load8(values + t * head_dim + 8 * i), x1 = load8(values + t * head_dim + 8 * i + 8);
      for (int r = 0; r < R; ++r) {
        const v8f p = splat(probs[r * prob_stride + t]);
        a[r][0] += p * x0;
        a[r][1] += p * x1;
      }
    }
    for (int r = 0; r < R; ++r) {
      store8(acc + r * head_dim + 8 * i, a[r][0]);
      store8(acc + r * head_dim + 8 * i + 8, a[r][1]);
    }
  }
  if (i < nv) {
    v8f a[R];
    for (int r = 0; r < R; ++r) a[r] = load8(acc + r * head_dim + 8 * i);
    for (int t = 0; t < count; ++t) {
      const v8f x0 = load8(values + t * head_dim + 8 * i);
      for (int r = 0; r < R; ++r) a[r] += splat(probs[r * prob_stride + t]) * x0;
    }
    for (int r = 0; r < R; ++r) store8(acc + r * head_dim + 8 * i, a[r]);
  }
}

// acc[g] += sum_t probs[g][t] * values[t] for `count` value rows, in blocks of up to 4 rows.
inline void accumulate_rows(const float* probs, int prob_stride, int group, int head_dim, const float* values,
                            int count, float* acc) {
  int g = 0;
  for (; g + 4 <= group; g += 4)
    accumulate_rows_r<4>(probs + g * prob_stride, prob_stride, head_dim, values, count, acc + g * head_dim);
  const float* p = probs + g * prob_stride;
  float* a = acc + g * head_dim;
  switch (group - g) {
    case 3: accumulate_rows_r<3>(p, prob_stride, head_dim, values, count, a); break;
    case 2: accumulate_rows_r<2>(p, prob_stride, head_dim, values, count, a); break;
    case 1: accumulate_rows_r<1>(p, prob_stride, head_dim, values, count, a); break;
    default: break;
  }
}

struct Args {
  const float* q;
  int64_t q_row_stride, q_head_stride;
  const float* k_pool;
  const float* v_pool;
  const int64_t* tables;
  int64_t table_stride;
  const int64_t* member_rows;    // query row (in q and out) of every member, group after group
  const int64_t* member_tables;  // its block table (a row of `tables`)
  const int64_t* member_ends;    // it attends positions [0, end)
  const int64_t* member_starts;  // [num_groups + 1]: group g is members [member_starts[g], member_starts[g + 1])
  const int64_t* shared_lens;    // [num_groups]: leading positions (a multiple of kChunkKeys) all members
                                 // of the group attend, held in the same blocks
  float* out;
  int64_t out_row_stride, out_head_stride;
  int64_t num_heads, num_kv_heads, head_dim, block_size, pool_blocks;
  float scale;
};

// Online-softmax state of `rows` query rows: the prescaled queries, running max and sum, and
// the weighted value sums.
struct RowState {
  int rows, head_dim;
  std::vector<float> q, acc, scores, run_max, run_sum;
  RowState(int rows_, int head_dim_)
      : rows(rows_), head_dim(head_dim_), q(static_cast<size_t>(rows_) * head_dim_),
        acc(static_cast<size_t>(rows_) * head_dim_, 0.0f), scores(static_cast<size_t>(rows_) * kChunkKeys),
        run_max(rows_, kEmptyMax), run_sum(rows_, 0.0f) {}
};

// Rows [row0, row0 + rows) of `state` attend positions [begin, end) of the sequence whose block
// table is `table`: chunks of at most kChunkKeys keys, each read once for all those rows.
void attend_range(const Args& a, RowState& state, int row0, int rows, const int64_t* table, int64_t begin,
                  int64_t end, const float* k_head, const float* v_head) {
  const int head_dim = state.head_dim;
  const int nv = head_dim / 8;
  const int64_t bs = a.block_size;
  const float* q = state.q.data() + static_cast<size_t>(row0) * head_dim;
  float* acc = state.acc.data() + static_cast<size_t>(row0) * head_dim;
  float* scores = state.scores.data();
  for (int64_t chunk = begin; chunk < end; chunk += kChunkKeys) {
    const int n = static_cast<int>(end - chunk < kChunkKeys ? end - chunk : kChunkKeys);
    for (int j = 0; j < n;) {  // scores, block by block
      const int64_t pos = chunk + j;
      const int64_t offset = pos % bs;
      const int count = static_cast<int>(bs - offset < n - j ? bs - offset : n - j);
      const float* keys = k_head + (table[pos / bs] * bs + offset) * head_dim;
      score_rows(q, rows, head_dim, keys, count, scores + j, kChunkKeys);
      j += count;
    }
    for (int g = 0; g < rows; ++g) {  // online softmax: rescale, then this chunk's weights
      float* row = scores + g * kChunkKeys;
      float& run_max = state.run_max[row0 + g];
      float top = run_max;
      for (int t = 0; t < n; ++t) top = row[t] > top ? row[t] : top;
      const float correction = exp8(splat(run_max - top))[0];
      v8f total = splat(0.0f);
      int t = 0;
      for (; t + 8 <= n; t += 8) {
        v8f p = exp8(load8(row + t) - splat(top));
        store8(row + t, p);
        total += p;
      }
      float tail = 0.0f;
      for (; t < n; ++t) {
        v8f p = exp8(splat(row[t] - top));
        row[t] = p[0];
        tail += p[0];
      }
      state.run_sum[row0 + g] = state.run_sum[row0 + g] * correction + (hsum(total) + tail);
      run_max = top;
      if (correction != 1.0f) {
        float* ag = acc + g * head_dim;
        for (int i = 0; i < nv; ++i) store8(ag + 8 * i, load8(ag + 8 * i) * splat(correction));
      }
    }
    for (int j = 0; j < n;) {  // values, block by block
      const int64_t pos = chunk + j;
      const int64_t offset = pos % bs;
      const int count = static_cast<int>(bs - offset < n - j ? bs - offset : n - j);
      const float* values = v_head + (table[pos / bs] * bs + offset) * head_dim;
      accumulate_rows(scores + j, kChunkKeys, rows, head_dim, values, count, acc);
      j += count;
    }
  }
}

// Members [lo, hi) of a group, all reading `table` and sorted by end, attend positions
// [begin, their end) chunk by chunk (chunks start at multiples of kChunkKeys): in each chunk the
// members that read all of it go as one block of rows, the others (their end inside the chunk)
// together with the members of the same end. A row's arithmetic depends only on its query, its
// end and the keys, never on the block it is computed in.
void attend_run(const Args& a, RowState& state, int group, int64_t lo, int64_t hi, const int64_t* ends,
                const int64_t* table, int64_t begin, const float* k_head, const float* v_head) {
  for (int64_t chunk = begin; lo < hi; chunk += kChunkKeys) {
    while (lo < hi && ends[lo] <= chunk) ++lo;
    int64_t full = lo;
    while (full < hi && ends[full] < chunk + kChunkKeys) ++full;
    for (int64_t m = lo; m < full;) {
      int64_t same = m;
      while (same < full && ends[same] == ends[m]) ++same;
      attend_range(a, state, static_cast<int>(m * group), static_cast<int>((same - m) * group), table, chunk, ends[m],
                   k_head, v_head);
      m = same;
    }
    if (full < hi)
      attend_range(a, state, static_cast<int>(full * group), static_cast<int>((hi - full) * group), table, chunk,
                   chunk + kChunkKeys, k_head, v_head);
  }
}

// One work item: a group of members (query tokens) and one KV head. The group's shared prefix is
// read once for every member's query rows (members x query heads of the KV head); then each run
// of members with the same block table reads the rest of its positions.
void attend_group(const Args& a, int64_t group_index, int64_t kv_head) {
  const int group = static_cast<int>(a.num_heads / a.num_kv_heads);
  const int head_dim = static_cast<int>(a.head_dim);
  const int nv = head_dim / 8;
  const int64_t first = a.member_starts[group_index];
  const int64_t num_members = a.member_starts[group_index + 1] - first;
  const int64_t* rows = a.member_rows + first;
  const int64_t* tables = a.member_tables + first;
  const int64_t* ends = a.member_ends + first;
  RowState state(static_cast<int>(num_members * group), head_dim);
  for (int64_t m = 0; m < num_members; ++m) {
    for (int g = 0; g < group; ++g) {
      const float* src = a.q + rows[m] * a.q_row_stride + (kv_head * group + g) * a.q_head_stride;
      float* dst = state.q.data() + static_cast<size_t>(m * group + g) * head_dim;
      for (int i = 0; i < nv; ++i) store8(dst + 8 * i, load8(src + 8 * i) * splat(a.scale));
    }
  }
  const float* k_head = a.k_pool + kv_head * a.pool_blocks * a.block_size * head_dim;
  const float* v_head = a.v_pool + kv_head * a.pool_blocks * a.block_size * head_dim;
  const int64_t shared = a.shared_lens[group_index];
  attend_range(a, state, 0, static_cast<int>(num_members * group), a.tables + tables[0] * a.table_stride, 0, shared,
               k_head, v_head);
  for (int64_t lo = 0; lo < num_members;) {
    int64_t hi = lo;
    while (hi < num_members && tables[hi] == tables[lo]) ++hi;
    attend_run(a, state, group, lo, hi, ends, a.tables + tables[lo] * a.table_stride, shared, k_head, v_head);
    lo = hi;
  }
  for (int64_t m = 0; m < num_members; ++m) {
    for (int g = 0; g < group; ++g) {
      const int64_t row = m * group + g;
      float* dst = a.out + rows[m] * a.out_row_stride + (kv_head * group + g) * a.out_head_stride;
      const v8f inv = splat(state.run_sum[row] > 0.0f ? 1.0f / state.run_sum[row] : 0.0f);
      const float* acc = state.acc.data() + static_cast<size_t>(row) * head_dim;
      for (int i = 0; i < nv; ++i) store8(dst + 8 * i, load8(acc + 8 * i) * inv);
    }
  }
}

}  // namespace

extern "C" {

// 0: done; 1: a shape this kernel does not support (nothing written). Query tokens ("members")
// come in groups; work items are (group, KV head) pairs, `items` [num_items, 2], taken by the
// threads one at a time (dynamic schedule: groups differ in size); `num_threads`: torch's count
// (OpenMP's own default is per calling thread: an engine thread would not see torch.set_num_threads).
int kvroute_paged_attention(const float* q, int64_t q_row_stride, int64_t q_head_stride, const float* k_pool,
                            const float* v_pool, const int64_t* tables, int64_t table_stride,
                            const int64_t* member_rows, const int64_t* member_tables, const int64_t* member_ends,
                            const int64_t* member_starts, const int64_t* shared_lens, const int64_t* items,
                            int64_t num_items, float* out, int64_t out_row_stride, int64_t out_head_stride,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            int64_t pool_blocks, float scale, int num_threads) {
  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > kMaxGroup) return 1;
  if (head_dim % 8 != 0 || head_dim > kMaxHeadDim || block_size < 1) return 1;
  const Args a{q, q_row_stride, q_head_stride, k_pool, v_pool, tables, table_stride, member_rows, member_tables,
               member_ends, member_starts, shared_lens, out, out_row_stride, out_head_stride, num_heads,
               num_kv_heads, head_dim, block_size, pool_blocks, scale};
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t item = 0; item < num_items; ++item) attend_group(a, items[2 * item], items[2 * item + 1]);
  return 0;
}

int kvroute_native_abi_version() { return 5; }

}  // extern "C"
