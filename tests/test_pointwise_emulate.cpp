// Runs codegen/pointwise.h's kernels on the host: the kernel text (KERNEL_TEXT, written by
// test_pointwise_runtime.py: #define CG_ARITY, the prelude, a generated part, the epilogue)
// is compiled here as C++ with the CUDA qualifiers defined away and threadIdx/blockIdx as
// globals, and every thread of the grid the host planned is run in turn. For views in
// many layouts (contiguous, broadcast rows/columns/scalars, column slices, misaligned or
// odd row strides, transposed, 3-D, ragged tails, in place) each output element must equal
// expr of the inputs read through numpy broadcasting, nothing outside the output view may
// be written, and both kernels must agree with the reference on every grid. Prints "ok: ..."
// or what differed.
#include "codegen/pointwise.h"

#include <math.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __launch_bounds__
#define __launch_bounds__(threads)

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
long long expr_calls = 0;  // the generated parts of the test count their calls

#include KERNEL_TEXT

namespace rt = codegen_rt;

// The kernel ABI: the host's structs are the kernel's with room for every arity.
static_assert(offsetof(cg_args, sizes) == offsetof(rt::PointwiseArgs, sizes));
static_assert(offsetof(cg_args, out) == offsetof(rt::PointwiseArgs, out));
static_assert(offsetof(cg_args, in) == offsetof(rt::PointwiseArgs, in));
static_assert(sizeof(cg_operand) == sizeof(rt::PointwiseOperand));
static_assert(sizeof(cg_args) <= sizeof(rt::PointwiseArgs));
static_assert(offsetof(cg_layout, itemsizes) == offsetof(rt::PointwiseLayout, itemsizes));
static_assert(sizeof(cg_layout) == offsetof(rt::PointwiseLayout, itemsizes) +
                                       sizeof(int) * (1 + CG_ARITY));

static int failures = 0;
static int runs = 0;

#define EXPECT(cond, ...)                  \
  do {                                     \
    if (!(cond)) {                         \
      ++failures;                          \
      std::printf("FAIL: " __VA_ARGS__);   \
      std::printf("\n");                   \
    }                                      \
  } while (0)

// A view into a buffer of `elements` elements: sizes, strides, offset in elements.
struct Spec {
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  int64_t elements = 0;  // of the buffer; 0: just enough
};

static Spec dense(std::vector<int64_t> sizes) {
  Spec s;
  s.sizes = sizes;
  s.strides.assign(sizes.size(), 1);
  for (size_t d = sizes.size(); d-- > 1;) s.strides[d - 1] = s.strides[d] * sizes[d];
  return s;
}

static Spec view(std::vector<int64_t> sizes, std::vector<int64_t> strides, int64_t offset = 0) {
  return Spec{sizes, strides, offset, 0};
}

static int64_t extent(const Spec& s) {
  int64_t last = s.offset;
  for (size_t d = 0; d < s.sizes.size(); ++d) {
    if (s.sizes[d] == 0) return s.offset;
    last += (s.sizes[d] - 1) * s.strides[d];
  }
  return last + 1;
}

struct Buffer {
  std::vector<unsigned char> bytes;  // + 16 for alignment
  unsigned char* base = nullptr;     // 16-byte aligned
  int64_t itemsize = 0;
  int64_t elements = 0;

  Buffer(int64_t n, int64_t item) : bytes(static_cast<size_t>(n * item + 16)), itemsize(item),
                                    elements(n) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(bytes.data());
    base = bytes.data() + (16 - p % 16) % 16;
  }
};

static rt::View as_view(const Spec& s, const Buffer& b) {
  rt::View v;
  v.data = reinterpret_cast<char*>(b.base) + s.offset * b.itemsize;
  v.dim = static_cast<int>(s.sizes.size());
  v.itemsize = b.itemsize;
  for (int d = 0; d < v.dim; ++d) {
    v.sizes[d] = s.sizes[d];
    v.strides[d] = s.strides[d];
  }
  return v;
}

template <class T>
static void fill(Buffer& b, int seed) {
  for (int64_t i = 0; i < b.elements; ++i) {
    const int64_t k = (i * 7 + seed * 5) % 23 - 11;
    if constexpr (std::is_same_v<T, f8e4m3>) {  // read-only types: their bytes, no NaN
      const unsigned char bits = static_cast<unsigned char>((i * 37 + seed * 11) % 256);
      reinterpret_cast<T*>(b.base)[i].bits = (bits & 0x7f) == 0x7f ? bits ^ 1 : bits;
    } else if constexpr (std::is_same_v<T, i8>) {
      reinterpret_cast<T*>(b.base)[i].bits = static_cast<unsigned char>(k * 11);
    } else {  // small multiples of 1/4: exact in every storage type
      from_compute(static_cast<float>(k) * 0.25f, reinterpret_cast<T*>(b.base)[i]);
    }
  }
}

// out's element at `index` (out's dims) read by `in` through numpy broadcasting.
static const char* element(const rt::View& in, const rt::View& out, const int64_t* index) {
  const char* p = in.data;
  for (int d = 0; d < in.dim; ++d) {
    const int o = d + out.dim - in.dim;
    if (in.sizes[d] != 1) p += index[o] * in.strides[d] * in.itemsize;
  }
  return p;
}

static int64_t numel(const rt::View& v) {
  int64_t n = 1;
  for (int d = 0; d < v.dim; ++d) n *= v.sizes[d];
  return n;
}

static void unravel(const rt::View& v, int64_t k, int64_t* index) {
  for (int d = v.dim; d-- > 0;) {
    index[d] = k % v.sizes[d];
    k /= v.sizes[d];
  }
}

template <int... I>
static out_t reference_at(const rt::View& out, const rt::View* in, const int64_t* index,
                          cg_seq<I...>) {
  out_t r;
  from_compute(expr(load<compute_t>(reinterpret_cast<const typename cg_in<I>::type*>(
                   element(in[I], out, index)))...),
               r);
  return r;
}

static void run_grid(const rt::PointwisePlan& plan, bool vector, dim3 grid, dim3 block) {
  cg_args a;
  std::memcpy(&a, &plan.args, sizeof a);  // what cudaLaunchKernel copies
  gridDim = grid;
  blockDim = block;
  for (blockIdx.z = 0; blockIdx.z < grid.z; ++blockIdx.z)
    for (blockIdx.y = 0; blockIdx.y < grid.y; ++blockIdx.y)
      for (blockIdx.x = 0; blockIdx.x < grid.x; ++blockIdx.x)
        for (threadIdx.z = 0; threadIdx.z < block.z; ++threadIdx.z)
          for (threadIdx.y = 0; threadIdx.y < block.y; ++threadIdx.y)
            for (threadIdx.x = 0; threadIdx.x < block.x; ++threadIdx.x)
              (vector ? cg_pointwise_vector : cg_pointwise_strided)(a);
}

static rt::PointwiseLayout layout() {
  rt::PointwiseLayout l;
  std::memcpy(static_cast<void*>(&l), &cg_pointwise_layout, sizeof cg_pointwise_layout);  // as the host reads it
  return l;
}

enum class Path { Vector, Strided, Either };

struct Case {
  std::string name;
  Spec out;
  std::function<Spec(int)> input;  // input k
  std::function<Path(int)> expect;  // from the kernel's vector width
  bool in_place = false;            // out is input 0's view of its buffer
};

static void check_case(const Case& c) {
  const rt::PointwiseLayout lay = layout();
  const int64_t out_item = sizeof(out_t);
  const int64_t in_items[] = {static_cast<int64_t>(sizeof(typename cg_in<0>::type))
#if CG_ARITY > 1
                              , static_cast<int64_t>(sizeof(typename cg_in<1>::type))
#endif
#if CG_ARITY > 2
                              , static_cast<int64_t>(sizeof(typename cg_in<2>::type))
#endif
#if CG_ARITY > 3
                              , static_cast<int64_t>(sizeof(typename cg_in<3>::type))
#endif
#if CG_ARITY > 4
                              , static_cast<int64_t>(sizeof(typename cg_in<4>::type))
#endif
#if CG_ARITY > 5
                              , static_cast<int64_t>(sizeof(typename cg_in<5>::type))
#endif
#if CG_ARITY > 6
                              , static_cast<int64_t>(sizeof(typename cg_in<6>::type))
#endif
#if CG_ARITY > 7
                              , static_cast<int64_t>(sizeof(typename cg_in<7>::type))
#endif
  };
  std::vector<Spec> specs;
  std::vector<Buffer> buffers;
  for (int k = 0; k < CG_ARITY; ++k) {
    specs.push_back(c.input(k));
    const int64_t n = std::max(specs[k].elements, extent(specs[k]));
    buffers.emplace_back(n, in_items[k]);
  }
  [&]<int... I>(cg_seq<I...>) {
    (fill<typename cg_in<I>::type>(buffers[I], I + 1), ...);
  }(cg_inputs{});
  if (c.in_place && in_items[0] != out_item) return;  // in place needs one element type
  const int64_t out_elements = std::max(c.out.elements, extent(c.out));
  Buffer pristine(out_elements, out_item);
  std::memset(pristine.base, 0xA5, static_cast<size_t>(out_elements * out_item));
  if (c.in_place) std::memcpy(pristine.base, buffers[0].base, out_elements * out_item);

  // The reference, from the inputs before any run.
  rt::View in_views[rt::kMaxPointwiseArity];
  for (int k = 0; k < CG_ARITY; ++k) in_views[k] = as_view(specs[k], buffers[k]);
  const rt::View out_shape = as_view(c.out, pristine);
  std::vector<out_t> expected(static_cast<size_t>(numel(out_shape)));
  std::vector<char> inside(static_cast<size_t>(out_elements), 0);
  for (int64_t k = 0; k < numel(out_shape); ++k) {
    int64_t index[rt::kMaxDims] = {0, 0, 0};
    unravel(out_shape, k, index);
    expected[k] = reference_at(out_shape, in_views, index, cg_inputs{});
    int64_t e = c.out.offset;
    for (int d = 0; d < out_shape.dim; ++d) e += index[d] * out_shape.strides[d];
    inside[e] = 1;
  }

  const auto attempt = [&](const char* how, bool vector, bool tiny_grid) {
    Buffer out(out_elements, out_item);
    std::memcpy(out.base, pristine.base, static_cast<size_t>(out_elements * out_item));
    rt::View ins[rt::kMaxPointwiseArity];
    for (int k = 0; k < CG_ARITY; ++k) ins[k] = in_views[k];
    const rt::View o = as_view(c.out, out);
    if (c.in_place) ins[0] = o;
    const rt::PointwiseArgs args = rt::pointwise_args(o, ins, CG_ARITY, "emulate", c.name.c_str());
    rt::check_itemsizes(lay, o, ins, CG_ARITY, "emulate", c.name.c_str());
    const rt::PointwisePlan plan = rt::plan_pointwise(args, CG_ARITY, lay, rt::kPointwiseThreads);
    if (rt::pointwise_empty(args)) {
      EXPECT(numel(o) == 0, "%s: empty args for a non-empty output", c.name.c_str());
      return;
    }
    const unsigned threads = plan.launch.block.x * plan.launch.block.y * plan.launch.block.z;
    EXPECT(threads <= rt::kPointwiseThreads && plan.launch.grid.y <= 65535 &&
               plan.launch.grid.z <= 65535,
           "%s: grid (%u, %u, %u) block (%u, %u, %u)", c.name.c_str(), plan.launch.grid.x,
           plan.launch.grid.y, plan.launch.grid.z, plan.launch.block.x, plan.launch.block.y,
           plan.launch.block.z);
    dim3 grid = plan.launch.grid, block = plan.launch.block;
    if (tiny_grid) {  // every loop of the kernel takes more than one step
      grid = dim3(1, 1, 1);
      block = dim3(2, 2, 1);
    }
    ++runs;
    expr_calls = 0;
    run_grid(plan, vector, grid, block);
    EXPECT(expr_calls == numel(o), "%s (%s): expr ran %lld times for %lld elements",
           c.name.c_str(), how, expr_calls, static_cast<long long>(numel(o)));
    for (int64_t k = 0; k < numel(o); ++k) {
      int64_t index[rt::kMaxDims] = {0, 0, 0};
      unravel(o, k, index);
      int64_t e = c.out.offset;
      for (int d = 0; d < o.dim; ++d) e += index[d] * o.strides[d];
      const unsigned char* got = out.base + e * out_item;
      if (std::memcmp(got, &expected[k], out_item) != 0) {
        EXPECT(false, "%s (%s): element %lld differs: got %g, expected %g", c.name.c_str(), how,
               static_cast<long long>(k), static_cast<double>(load<double>(
                                              reinterpret_cast<const out_t*>(got))),
               static_cast<double>(load<double>(&expected[k])));
        return;
      }
    }
    for (int64_t e = 0; e < out_elements; ++e) {
      if (inside[e]) continue;
      if (std::memcmp(out.base + e * out_item, pristine.base + e * out_item, out_item) != 0) {
        EXPECT(false, "%s (%s): element %lld of the buffer outside the view was written",
               c.name.c_str(), how, static_cast<long long>(e));
        return;
      }
    }
  };

  {
    rt::View o = as_view(c.out, pristine);
    rt::View ins[rt::kMaxPointwiseArity];
    for (int k = 0; k < CG_ARITY; ++k) ins[k] = c.in_place && k == 0 ? o : in_views[k];
    const rt::PointwisePlan plan = rt::plan_pointwise(
        rt::pointwise_args(o, ins, CG_ARITY, "emulate", c.name.c_str()), CG_ARITY, lay,
        rt::kPointwiseThreads);
    const Path want = c.expect(lay.vector_width);
    EXPECT(want == Path::Either || plan.vector == (want == Path::Vector), "%s: planned the %s kernel, expected the %s one",
           c.name.c_str(), plan.vector ? "vector" : "strided",
           want == Path::Vector ? "vector" : "strided");
    attempt("planned", plan.vector, false);
    if (plan.vector) attempt("vector, one small block", true, true);
  }
  attempt("strided", false, false);
  attempt("strided, one small block", false, true);
}

static Path vector(int) { return Path::Vector; }
static Path strided(int) { return Path::Strided; }
static Path either(int) { return Path::Either; }

static void cases() {
  const int64_t m = 5, n = 24, b = 3;
  std::vector<Case> all;
  all.push_back({"contiguous [m, n]", dense({m, n}), [&](int) { return dense({m, n}); }, vector});
  all.push_back({"bias [n] against [m, n]", dense({m, n}),
                 [&](int k) { return k % 2 == 0 ? dense({n}) : dense({m, n}); }, vector});
  all.push_back({"row [1, n] against [m, n]", dense({m, n}),
                 [&](int k) { return k % 2 == 0 ? dense({1, n}) : dense({m, n}); }, vector});
  all.push_back({"column [m, 1] against [m, n]", dense({m, n}),
                 [&](int k) { return k % 2 == 0 ? dense({m, 1}) : dense({m, n}); }, vector});
  all.push_back({"scalar [1] and rank 0", dense({m, n}),
                 [&](int k) { return k % 3 == 0 ? dense({1}) : k % 3 == 1 ? dense({}) : dense({m, n}); },
                 vector});
  all.push_back({"column slice of [m, 40] at 8 (row stride 40)", view({m, 16}, {40, 1}, 8),
                 [&](int) { return Spec{{m, 16}, {40, 1}, 16, m * 40}; }, vector});
  all.push_back({"column slice at 1 (misaligned)", view({m, 16}, {40, 1}, 1),
                 [&](int) { return Spec{{m, 16}, {40, 1}, 8, m * 40}; }, strided});
  all.push_back({"an input misaligned", dense({m, n}),
                 [&](int k) { return k == 0 ? view({m, n}, {n, 1}, 1) : dense({m, n}); },
                 strided});
  all.push_back({"row stride 17", view({m, 16}, {17, 1}), [&](int) { return dense({m, 16}); },
                 strided});
  all.push_back({"transposed input", dense({m, n}),
                 [&](int k) { return k == 0 ? view({m, n}, {1, m}) : dense({m, n}); }, strided});
  // Ordered by out's strides, the innermost dim is m = 8, contiguous for the transposed
  // operands and broadcast for the bias.
  all.push_back({"transposed output and inputs", view({8, n}, {1, 8}),
                 [&](int k) { return k % 2 == 0 ? view({8, n}, {1, 8}) : dense({n}); },
                 vector});
  all.push_back({"3-D [b, m, 16] in [b, m + 1, 24]", view({b, m, 16}, {(m + 1) * 24, 24, 1}),
                 [&](int k) {
                   return k % 3 == 0   ? dense({b, m, 16})
                          : k % 3 == 1 ? dense({m, 1})
                                       : dense({b, 1, 16});
                 },
                 vector});
  all.push_back({"3-D merged: [b, m, n] contiguous", dense({b, m, n}),
                 [&](int k) { return k % 2 == 0 ? dense({b, m, n}) : dense({n}); }, vector});
  for (int64_t cols : {13, 15}) {  // 15: one element short of a last vector for every width
    all.push_back({"ragged rows: [m, " + std::to_string(cols) + "] in [m, 16]",
                   view({m, cols}, {16, 1}), [=](int) { return view({m, cols}, {16, 1}); },
                   [=](int v) { return cols >= v ? Path::Vector : Path::Strided; }});
  }
  all.push_back({"rows shorter than a vector: [m, 3] in [m, 8]", view({m, 3}, {8, 1}),
                 [&](int) { return view({m, 3}, {8, 1}); },
                 [&](int v) { return 3 >= v ? Path::Vector : Path::Strided; }});
  all.push_back({"many rows [700, 8]", dense({700, 8}), [&](int) { return dense({700, 8}); },
                 vector});
  all.push_back({"one element", dense({1, 1}), [&](int) { return dense({1}); }, strided});
  all.push_back({"empty [0, n]", dense({0, n}), [&](int) { return dense({n}); }, either});
  Case in_place{"in place, out = input 0", dense({m, n}), [&](int) { return dense({m, n}); },
                vector};
  in_place.in_place = true;
  all.push_back(in_place);
  for (const Case& c : all) check_case(c);
}

static void expect_error(const char* what, const std::function<void()>& f,
                         std::vector<std::string> parts) {
  try {
    f();
    EXPECT(false, "%s: no error", what);
  } catch (const std::runtime_error& e) {
    for (const std::string& part : parts) {
      EXPECT(std::string(e.what()).find(part) != std::string::npos, "%s: '%s' lacks '%s'", what,
             e.what(), part.c_str());
    }
  }
}

static void errors() {
  Buffer buffer(1024, 8);
  const auto args = [&](const Spec& out, const Spec& in) {
    rt::View ins[rt::kMaxPointwiseArity];
    for (int k = 0; k < CG_ARITY; ++k) ins[k] = as_view(k == CG_ARITY - 1 ? in : out, buffer);
    rt::pointwise_args(as_view(out, buffer), ins, CG_ARITY, "myop", "Mul(T3_i, T4_i, out=T5_i)");
  };
  const std::string last = std::to_string(CG_ARITY - 1);
  expect_error("size mismatch", [&] { args(dense({5, 24}), dense({5, 25})); },
               {"myop: pointwise kernel Mul(T3_i, T4_i, out=T5_i): input " + last,
                "shape [5, 25]", "output's shape [5, 24]"});
  expect_error("not a size-1 dim", [&] { args(dense({5, 24}), dense({2, 24})); },
               {"input " + last, "[2, 24]", "[5, 24]"});
  expect_error("higher rank", [&] { args(dense({24}), dense({1, 24})); },
               {"input " + last, "[1, 24]", "[24]"});
  expect_error("output sharing memory", [&] { args(view({5, 24}, {0, 1}), dense({24})); },
               {"myop", "share memory"});
  const rt::PointwiseLayout lay = layout();
  expect_error("itemsize", [&] {
    Buffer wide(64, 16);
    rt::View ins[rt::kMaxPointwiseArity];
    for (int k = 0; k < CG_ARITY; ++k) ins[k] = as_view(dense({4}), wide);
    rt::check_itemsizes(lay, as_view(dense({4}), wide), ins, CG_ARITY, "myop", "K");
  }, {"myop: pointwise kernel K", "16-byte elements"});
}

static void grids() {
  rt::PointwiseArgs a;
  a.sizes[0] = 70000;
  a.sizes[1] = 3;
  a.sizes[2] = int64_t{1} << 42;
  const rt::PointwiseGrid g = rt::pointwise_grid(a, 8, 256);
  EXPECT(g.grid.z == 65535 && g.grid.x == 2147483647u && g.block.x == 256 && g.block.y == 1,
         "huge grid: (%u, %u, %u) block (%u, %u)", g.grid.x, g.grid.y, g.grid.z, g.block.x,
         g.block.y);
  a.sizes[0] = 1;
  a.sizes[1] = 1000000;
  a.sizes[2] = 8;
  const rt::PointwiseGrid rows = rt::pointwise_grid(a, 8, 256);
  EXPECT(rows.block.x == 1 && rows.block.y == 256 && rows.grid.y == 3907,
         "tall grid: (%u, %u) block (%u, %u)", rows.grid.x, rows.grid.y, rows.block.x,
         rows.block.y);
  a.sizes[1] = 4096;
  a.sizes[2] = 1376;  // a column slice of 11008 / 8 in bf16: 172 steps of 8
  const rt::PointwiseGrid slice = rt::pointwise_grid(a, 8, 256);
  EXPECT(slice.block.x == 192 && slice.block.y == 1 && slice.grid.x == 1 &&
             slice.grid.y == 4096,
         "column slice grid: (%u, %u) block (%u, %u)", slice.grid.x, slice.grid.y, slice.block.x,
         slice.block.y);
  a.sizes[1] = 3;
  a.sizes[2] = 40;
  const rt::PointwiseGrid small = rt::pointwise_grid(a, 8, 256);
  EXPECT(small.block.x == 8 && small.block.y == 4 && small.grid.x == 1 && small.grid.y == 1,
         "small grid: (%u, %u) block (%u, %u)", small.grid.x, small.grid.y, small.block.x,
         small.block.y);
}

int main() {
  cases();
  errors();
  grids();
  if (failures > 0) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("ok: %d runs, vector width %d\n", runs, layout().vector_width);
  return 0;
}
