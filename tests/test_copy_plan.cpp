// Checks codegen_rt::copy_shape on the host: every copy the runtime would issue is
// emulated with memcpy (cudaMemcpy2DAsync's semantics), for slices of host tensors in
// many layouts, into staging slots (dense in the slice's order) and back.
#include "codegen/copy.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace rt = codegen_rt;

struct Emulated {
  int64_t calls = 0, calls_2d = 0;
};

// What cudaMemcpy2DAsync refuses (cudaErrorInvalidPitchValue / InvalidValue): a copy
// shape the CPU would take but the GPU not.
static bool valid_for_cuda(const rt::CopyShape& c) {
  if (c.count == 0) return true;
  if (c.width <= 0) return false;
  return c.height <= 1 || (c.src_pitch >= c.width && c.dst_pitch >= c.width &&
                           c.src_pitch <= rt::kMaxPitch && c.dst_pitch <= rt::kMaxPitch);
}

static int invalid_shapes = 0;

static void emulate(const rt::View& dst, const rt::View& src, Emulated& e) {
  const rt::CopyShape c = rt::copy_shape(dst, src, "test");
  if (!valid_for_cuda(c)) {
    ++invalid_shapes;
    std::printf("INVALID for CUDA: width %lld, pitches %lld / %lld, height %lld\n",
                static_cast<long long>(c.width), static_cast<long long>(c.src_pitch),
                static_cast<long long>(c.dst_pitch), static_cast<long long>(c.height));
  }
  for (int64_t b = 0; b < c.count; ++b) {
    ++e.calls;
    if (c.height > 1) ++e.calls_2d;
    for (int64_t h = 0; h < c.height; ++h) {
      std::memcpy(dst.data + b * c.dst_step + h * c.dst_pitch,
                  src.data + b * c.src_step + h * c.src_pitch, static_cast<size_t>(c.width));
    }
  }
}

static int64_t offset(const rt::View& v, const int64_t* idx) {
  int64_t o = 0;
  for (int d = 0; d < v.dim; ++d) o += idx[d] * v.strides[d];
  return o;
}

// Every element of `a` equals the one of `b` at the same index.
static bool same(const rt::View& a, const rt::View& b) {
  int64_t idx[rt::kMaxDims] = {0, 0, 0};
  int64_t n = 1;
  for (int d = 0; d < a.dim; ++d) n *= a.sizes[d];
  for (int64_t k = 0; k < n; ++k) {
    int64_t r = k;
    for (int d = a.dim; d-- > 0;) {
      idx[d] = r % a.sizes[d];
      r /= a.sizes[d];
    }
    const float* x = reinterpret_cast<const float*>(a.data) + offset(a, idx);
    const float* y = reinterpret_cast<const float*>(b.data) + offset(b, idx);
    if (*x != *y) return false;
  }
  return true;
}

static int64_t numel(const rt::View& v) {
  int64_t n = 1;
  for (int d = 0; d < v.dim; ++d) n *= v.sizes[d];
  return n;
}

static int failures = 0;
static int64_t cases = 0;

// A host tensor of `sizes`/`strides` over `storage` floats; slice `index` of `slices`
// along `axis`; copied into a slot and back into a copy of the host tensor.
static void check(const char* name, int dim, std::vector<int64_t> sizes,
                  std::vector<int64_t> strides, int64_t storage, int axis, int64_t slices,
                  int64_t expect_calls = -1, int64_t expect_2d = -1) {
  std::vector<float> host(static_cast<size_t>(storage)), back(static_cast<size_t>(storage), -1);
  for (int64_t k = 0; k < storage; ++k) host[static_cast<size_t>(k)] = static_cast<float>(k + 1);
  rt::View h;
  h.dim = dim;
  h.itemsize = 4;
  for (int d = 0; d < dim; ++d) h.sizes[d] = sizes[d], h.strides[d] = strides[d];
  const int64_t chunk = rt::ceil_div(h.sizes[axis], slices);
  for (int64_t i = 0; i < slices; ++i) {
    h.data = reinterpret_cast<char*>(host.data());
    rt::View slice = rt::shard(h, axis, i, chunk);
    // The slot's first numel(slice) elements (what rt::staging sizes a slot for, and the
    // host IR's StagingSlot means), then a guard that must stay untouched.
    constexpr float kUnwritten = -3;
    const size_t used = static_cast<size_t>(numel(slice));
    std::vector<float> slot(used + 8, kUnwritten);
    rt::View s = rt::dense_like(slice);  // as rt::slot lays a slot out
    s.data = reinterpret_cast<char*>(slot.data());
    Emulated in, out;
    emulate(s, slice, in);
    const bool exact_slot =
        std::none_of(slot.begin(), slot.begin() + static_cast<std::ptrdiff_t>(used),
                     [](float v) { return v == kUnwritten; }) &&
        std::all_of(slot.begin() + static_cast<std::ptrdiff_t>(used), slot.end(),
                    [](float v) { return v == kUnwritten; });
    rt::View b = slice;
    b.data = reinterpret_cast<char*>(back.data()) + (slice.data - h.data);
    emulate(b, s, out);
    ++cases;
    bool ok = exact_slot && same(s, slice) && same(b, slice);
    if (expect_calls >= 0 && (in.calls != expect_calls || out.calls != expect_calls)) ok = false;
    if (expect_2d >= 0 && (in.calls_2d != expect_2d || out.calls_2d != expect_2d)) ok = false;
    if (!ok) {
      ++failures;
      std::printf("FAIL %s slice %lld of %lld: calls %lld (2-D %lld)\n", name,
                  static_cast<long long>(i), static_cast<long long>(slices),
                  static_cast<long long>(in.calls), static_cast<long long>(in.calls_2d));
    }
  }
  // Elements outside every slice were never written.
  std::vector<bool> inside(static_cast<size_t>(storage), false);
  int64_t idx[rt::kMaxDims] = {0, 0, 0};
  int64_t n = 1;
  for (int d = 0; d < dim; ++d) n *= h.sizes[d];
  for (int64_t k = 0; k < n; ++k) {
    int64_t r = k;
    for (int d = dim; d-- > 0;) idx[d] = r % h.sizes[d], r /= h.sizes[d];
    inside[static_cast<size_t>(offset(h, idx))] = true;
  }
  for (int64_t k = 0; k < storage; ++k) {
    if (!inside[static_cast<size_t>(k)] && back[static_cast<size_t>(k)] != -1) {
      ++failures;
      std::printf("FAIL %s: wrote outside the view at %lld\n", name, static_cast<long long>(k));
      break;
    }
  }
}

int main() {
  for (int64_t slices : {1, 2, 3, 4, 8, 13, 20}) {
    for (int axis : {0, 1}) {
      check("row-major", 2, {13, 7}, {7, 1}, 91, axis, slices);
      check("row-major padded", 2, {13, 7}, {10, 1}, 130, axis, slices);
      check("column-major", 2, {13, 7}, {1, 13}, 91, axis, slices);
      check("column-major padded", 2, {13, 7}, {1, 16}, 112, axis, slices);
      check("one row", 2, {1, 7}, {7, 1}, 7, axis, slices);
      check("one column strided", 2, {13, 1}, {5, 1}, 65, axis, slices);
      // Layouts cuBLAS cannot read in place, which a host input may have (check_copyable).
      check("every other column", 2, {13, 7}, {14, 2}, 182, axis, slices);
      check("expanded column", 2, {13, 7}, {1, 0}, 13, axis, slices);
      check("expanded column of a row-major matrix", 2, {13, 7}, {5, 0}, 65, axis, slices);
      check("expanded row", 2, {13, 7}, {0, 1}, 7, axis, slices);
    }
    for (int axis : {0, 1, 2}) {
      check("batched", 3, {5, 4, 3}, {12, 3, 1}, 60, axis, slices);
      check("batched padded rows", 3, {5, 4, 3}, {24, 6, 1}, 120, axis, slices);
      check("batched column-major", 3, {5, 4, 3}, {12, 1, 4}, 60, axis, slices);
      check("batch permuted", 3, {5, 4, 3}, {3, 15, 1}, 60, axis, slices);
      check("batch expanded", 3, {5, 4, 3}, {0, 3, 1}, 12, axis, slices);
      check("rows broadcast", 3, {5, 4, 3}, {3, 0, 1}, 15, axis, slices);
      check("every other element", 3, {5, 4, 3}, {24, 6, 2}, 120, axis, slices);
    }
    check("vector", 1, {13}, {1}, 13, 0, slices);
    check("vector strided", 1, {13}, {3}, 39, 0, slices);
  }
  // Calls per slice: a row block is one 1-D copy, a column block one 2-D copy.
  check("rows of row-major: 1-D", 2, {16, 8}, {8, 1}, 128, 0, 4, 1, 0);
  check("columns of row-major: 2-D", 2, {16, 8}, {8, 1}, 128, 1, 4, 1, 1);
  check("columns of column-major: 1-D", 2, {16, 8}, {1, 16}, 128, 1, 4, 1, 0);
  check("rows of column-major: 2-D", 2, {16, 8}, {1, 16}, 128, 0, 4, 1, 1);
  check("batches of batched: 1-D", 3, {8, 4, 3}, {12, 3, 1}, 96, 0, 4, 1, 0);
  check("rows of padded batched: 2-D", 3, {8, 4, 3}, {24, 6, 1}, 192, 0, 4, 1, 1);
  check("rows of batched: one 2-D", 3, {8, 4, 3}, {12, 3, 1}, 96, 1, 2, 1, 1);
  check("expanded batch: a 2-D copy each", 3, {4, 4, 3}, {0, 3, 1}, 12, 0, 1, 4, 0);
  check("empty", 2, {0, 8}, {8, 1}, 1, 0, 4, 0, 0);
  // Rows whose pitch exceeds cudaMemcpy2D's maximum (2^31 - 1 bytes): the batch of a
  // [2, 65536, 32768] bf16 tensor (4 GiB matrices) sliced by rows is a count of 1-D
  // copies, not one 2-D copy with a 4 GiB pitch (planned only: nothing is copied).
  {
    rt::View big;
    big.dim = 3;
    big.itemsize = 2;
    const int64_t sizes[3] = {2, 65536, 32768}, strides[3] = {65536LL * 32768, 32768, 1};
    for (int d = 0; d < 3; ++d) big.sizes[d] = sizes[d], big.strides[d] = strides[d];
    const rt::View slice = rt::shard(big, 1, 0, 32768);
    rt::View slot = slice;
    rt::dense_strides(slot, false);
    for (const rt::CopyShape& c : {rt::copy_shape(slot, slice, "test"),
                                   rt::copy_shape(slice, slot, "test")}) {
      ++cases;
      const bool ok = c.count == 2 && c.height == 1 && c.width == 32768LL * 32768 * 2 &&
                      std::max(c.src_step, c.dst_step) == 65536LL * 32768 * 2;
      if (!ok) {
        ++failures;
        std::printf("FAIL pitch over the maximum: count %lld height %lld pitches %lld %lld\n",
                    static_cast<long long>(c.count), static_cast<long long>(c.height),
                    static_cast<long long>(std::max(c.src_pitch, c.dst_pitch)),
                    static_cast<long long>(std::max(c.src_step, c.dst_step)));
      }
    }
  }
  // check_copyable refuses a layout exactly when one of the copies the op would issue
  // (the whole tensor, or every slice of a split) has no plan; when it accepts, every
  // slice copies exactly (check() above), and its message names the argument.
  {
    struct Layout {
      int dim;
      std::vector<int64_t> sizes, strides;
      int64_t storage;
    };
    const std::vector<Layout> layouts = {
        {2, {13, 7}, {14, 2}, 182},       {2, {13, 7}, {5, 0}, 65},
        {3, {5, 4, 6}, {24, 6, 1}, 120},  {3, {5, 4, 3}, {24, 6, 2}, 120},
        {3, {5, 4, 3}, {48, 12, 2}, 240}, {3, {5, 4, 3}, {100, 12, 2}, 500},
        {3, {7, 5, 6}, {240, 24, 2}, 1680}, {3, {5, 4, 3}, {12, 1, 5}, 60},
        {3, {6, 4, 3}, {0, 6, 2}, 24},
        // Split in two along axis 1 (chunk 4, last 3): the batch merges into a full
        // slice's rows (28 = 4 * 7) but not into the last one's.
        {3, {3, 7, 3}, {28, 7, 2}, 103}};
    const auto view = [](const Layout& l) {
      rt::View v;
      v.dim = l.dim;
      v.itemsize = 4;
      for (int d = 0; d < l.dim; ++d) v.sizes[d] = l.sizes[d], v.strides[d] = l.strides[d];
      return v;
    };
    const auto refusal = [](const std::function<void()>& fn) {
      try {
        fn();
        return std::string();
      } catch (const std::runtime_error& e) {
        return std::string(e.what());
      }
    };
    int64_t refused = 0, accepted = 0;
    for (const Layout& l : layouts) {
      const rt::View t = view(l);
      const std::string whole = refusal([&] { rt::check_copyable(t, "prog", "T0"); });
      ++cases;
      if (whole.empty() != rt::copyable(t, "prog")) {
        ++failures;
        std::printf("FAIL check_copyable(whole) disagrees with copyable: '%s'\n", whole.c_str());
      }
      for (int axis = 0; axis < l.dim; ++axis) {
        for (int64_t slices : {1, 2, 3, 4, 7}) {
          const int64_t chunk = rt::ceil_div(t.sizes[axis], slices);
          const std::string error =
              refusal([&] { rt::check_copyable(t, "prog", "T0", axis, chunk); });
          bool plannable = true;  // every slice the op would copy
          for (int64_t i = 0; i < slices; ++i) {
            const rt::View slice = rt::shard(t, axis, i, chunk);
            plannable = plannable && rt::copyable(slice, "prog");
          }
          ++cases;
          if (error.empty() != plannable ||
              (!error.empty() && (error.find("prog: argument T0 has sizes") != 0 ||
                                  error.find("Pass T0.contiguous()") == std::string::npos))) {
            ++failures;
            std::printf("FAIL check_copyable axis %d, %lld slices: '%s', plannable %d\n", axis,
                        static_cast<long long>(slices), error.c_str(), plannable ? 1 : 0);
          }
          if (error.empty()) {
            ++accepted;
            check("accepted by check_copyable", l.dim, l.sizes, l.strides, l.storage, axis,
                  slices);
          } else {
            ++refused;
          }
        }
      }
    }
    ++cases;
    if (refused == 0 || accepted == 0) {  // the layouts above exercise both answers
      ++failures;
      std::printf("FAIL check_copyable: %lld refused, %lld accepted\n",
                  static_cast<long long>(refused), static_cast<long long>(accepted));
    }
  }
  failures += invalid_shapes;
  std::printf("%s: %lld cases, %d failures\n", failures ? "FAILED" : "ok",
              static_cast<long long>(cases), failures);
  return failures ? 1 : 0;
}
