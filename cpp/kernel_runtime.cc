#include "kernel_runtime.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <limits>
#include <map>
#include <tuple>

namespace jkr {
namespace {

constexpr int64_t kScratchAlign = 256;
constexpr int kMaxInlineParams = 64;

int64_t AlignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

std::string Prefix(const KernelCall& call, size_t config) {
  std::string s = "jax_kernel_runtime: kernel '" + call.name + "'";
  if (call.configs.size() > 1) s += " (config " + std::to_string(config) + ")";
  return s;
}

// Makes `ctx` current for the scope; XLA's thread may have none current.
class ScopedContext {
 public:
  ScopedContext(const DriverApi* api, CUcontext ctx) : api_(api) {
    CUcontext current = nullptr;
    api_->cuCtxGetCurrent(&current);
    if (current != ctx && api_->cuCtxPushCurrent(ctx) == CUDA_SUCCESS) {
      pushed_ = true;
    }
  }
  ~ScopedContext() {
    CUcontext ignored;
    if (pushed_) api_->cuCtxPopCurrent(&ignored);
  }

 private:
  const DriverApi* api_;
  bool pushed_ = false;
};

// Process-wide module cache: an image is loaded once per context however many
// call sites use it. Modules live until the process ends (XLA executables can
// be re-created at any time and would reload them otherwise).
std::mutex module_mu;
std::map<std::tuple<uint64_t, size_t, CUcontext>, CUmodule>& ModuleCache() {
  static auto* cache =
      new std::map<std::tuple<uint64_t, size_t, CUcontext>, CUmodule>();
  return *cache;
}

std::mutex tune_records_mu;
std::vector<TuneRecord>& TuneRecordStore() {
  static auto* records = new std::vector<TuneRecord>();
  return *records;
}

std::string LoadFunction(const DriverApi* api, CUcontext ctx,
                         const KernelConfig& cfg, CUfunction* out) {
  CUmodule module = nullptr;
  {
    std::lock_guard<std::mutex> lock(module_mu);
    auto key = std::make_tuple(cfg.image_hash, cfg.image.size(), ctx);
    auto it = ModuleCache().find(key);
    if (it != ModuleCache().end()) {
      module = it->second;
    } else {
      CUresult r = api->cuModuleLoadData(&module, cfg.image.data());
      if (r != CUDA_SUCCESS) {
        return "cannot load the kernel image (" +
               std::to_string(cfg.image.size()) +
               " bytes): cuModuleLoadData failed: " + CudaErrorString(api, r);
      }
      ModuleCache()[key] = module;
    }
  }
  CUresult r = api->cuModuleGetFunction(out, module, cfg.function.c_str());
  if (r != CUDA_SUCCESS) {
    return "no function '" + cfg.function +
           "' in the kernel image: " + CudaErrorString(api, r);
  }
  CUdevice device = 0;
  api->cuCtxGetDevice(&device);
  int optin = 0, static_shared = 0, max_threads = 0;
  api->cuDeviceGetAttribute(
      &optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device);
  api->cuFuncGetAttribute(&static_shared, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                          *out);
  api->cuFuncGetAttribute(&max_threads,
                          CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, *out);
  if (static_cast<int64_t>(cfg.shared_bytes) + static_shared > optin) {
    return "needs " + std::to_string(cfg.shared_bytes + static_shared) +
           " bytes of shared memory per block but the device allows at most " +
           std::to_string(optin) +
           " (use smaller blocks or fewer pipeline stages)";
  }
  // Above 48 KB a kernel must opt in to the larger dynamic shared memory.
  if (cfg.shared_bytes > 49152) {
    r = api->cuFuncSetAttribute(*out,
                                CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                optin - static_shared);
    if (r != CUDA_SUCCESS) {
      return "cannot opt in to " + std::to_string(cfg.shared_bytes) +
             " bytes of shared memory: " + CudaErrorString(api, r);
    }
  }
  int64_t threads = int64_t{cfg.block[0]} * cfg.block[1] * cfg.block[2];
  if (threads > max_threads) {
    return "needs " + std::to_string(threads) +
           " threads per block but the compiled function allows at most " +
           std::to_string(max_threads);
  }
  if (int64_t{cfg.cluster[0]} * cfg.cluster[1] * cfg.cluster[2] > 8) {
    api->cuFuncSetAttribute(
        *out, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1);
  }
  return "";
}

LoadedCall* FindOrLoad(KernelCall& call, const DriverApi* api, CUcontext ctx,
                       std::string* error) {
  std::lock_guard<std::mutex> lock(call.mu);
  LoadedCall* loaded = nullptr;
  for (auto& l : call.loaded) {
    if (l->ctx == ctx) loaded = l.get();
  }
  if (loaded == nullptr) {
    auto l = std::make_unique<LoadedCall>();
    l->ctx = ctx;
    int usable = 0, last_usable = -1;
    for (size_t i = 0; i < call.configs.size(); ++i) {
      CUfunction fn = nullptr;
      std::string err = LoadFunction(api, ctx, call.configs[i], &fn);
      l->functions.push_back(err.empty() ? fn : nullptr);
      l->errors.push_back(err);
      if (err.empty()) ++usable, last_usable = static_cast<int>(i);
    }
    // With one usable config there is nothing to tune.
    if (usable == 1) l->chosen = last_usable;
    loaded = l.get();
    call.loaded.push_back(std::move(l));
  }
  if (std::none_of(loaded->functions.begin(), loaded->functions.end(),
                   [](CUfunction f) { return f != nullptr; })) {
    *error = Prefix(call, 0) + ": " + loaded->errors[0];
    return nullptr;
  }
  return loaded;
}

std::string Launch(const DriverApi* api, const KernelCall& call, size_t index,
                   CUfunction fn, CUstream stream, const CallBuffers& b) {
  const KernelConfig& cfg = call.configs[index];
  size_t n = call.params.size() + (cfg.scratch_params ? 2 : 0);
  uint64_t inline_values[kMaxInlineParams];
  void* inline_ptrs[kMaxInlineParams];
  std::vector<uint64_t> heap_values;
  std::vector<void*> heap_ptrs;
  uint64_t* values = inline_values;
  void** ptrs = inline_ptrs;
  if (n > kMaxInlineParams) {
    heap_values.resize(n), heap_ptrs.resize(n);
    values = heap_values.data(), ptrs = heap_ptrs.data();
  }
  for (size_t i = 0; i < call.params.size(); ++i) {
    const Param& p = call.params[i];
    values[i] = p.is_buffer ? b.ptrs[p.operand] : p.bits;
    ptrs[i] = &values[i];  // little-endian: low bytes hold narrow scalars
  }
  if (cfg.scratch_params) {
    int64_t programs = int64_t{cfg.grid[0]} * cfg.grid[1] * cfg.grid[2] *
                       cfg.cluster[0] * cfg.cluster[1] * cfg.cluster[2];
    int64_t global = AlignUp(programs * cfg.global_scratch_bytes, kScratchAlign);
    size_t i = call.params.size();
    values[i] = cfg.global_scratch_bytes > 0 ? b.scratch : 0;
    values[i + 1] = cfg.profile_scratch_bytes > 0 ? b.scratch + global : 0;
    ptrs[i] = &values[i], ptrs[i + 1] = &values[i + 1];
  }
  unsigned gx = cfg.grid[0] * cfg.cluster[0];
  unsigned gy = cfg.grid[1] * cfg.cluster[1];
  unsigned gz = cfg.grid[2] * cfg.cluster[2];
  bool clustered = cfg.cluster[0] * cfg.cluster[1] * cfg.cluster[2] > 1;
  CUresult r;
  if (!clustered && !cfg.cooperative && !cfg.pdl) {
    r = api->cuLaunchKernel(fn, gx, gy, gz, cfg.block[0], cfg.block[1],
                            cfg.block[2], cfg.shared_bytes, stream, ptrs,
                            nullptr);
  } else {
    CUlaunchAttribute attrs[4] = {};
    unsigned num_attrs = 0;
    if (clustered) {
      attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
      attrs[num_attrs].value.clusterDim = {cfg.cluster[0], cfg.cluster[1],
                                           cfg.cluster[2]};
      ++num_attrs;
      attrs[num_attrs].id =
          CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE;
      attrs[num_attrs].value.clusterSchedulingPolicyPreference =
          CU_CLUSTER_SCHEDULING_POLICY_SPREAD;
      ++num_attrs;
    }
    if (cfg.cooperative) {
      attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
      attrs[num_attrs++].value.cooperative = 1;
    }
    if (cfg.pdl) {
      attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attrs[num_attrs++].value.programmaticStreamSerializationAllowed = 1;
    }
    CUlaunchConfig lc = {gx,     gy,   gz,        cfg.block[0], cfg.block[1],
                         cfg.block[2], cfg.shared_bytes, stream, attrs,
                         num_attrs};
    r = api->cuLaunchKernelEx(&lc, fn, ptrs, nullptr);
  }
  if (r != CUDA_SUCCESS) {
    return Prefix(call, index) + ": launch of function '" + cfg.function +
           "' failed: " + CudaErrorString(api, r);
  }
  return "";
}

std::string ZeroOutputs(const DriverApi* api, const KernelCall& call,
                        CUstream stream, const CallBuffers& b) {
  for (int64_t o : call.zeroed_outputs) {
    size_t k = b.num_inputs + o;
    CUresult r = api->cuMemsetD8Async(b.ptrs[k], 0, b.sizes[k], stream);
    if (r != CUDA_SUCCESS) {
      return Prefix(call, 0) + ": zeroing output " + std::to_string(o) +
             " failed: " + CudaErrorString(api, r);
    }
  }
  return "";
}

#define JKR_CHECK(expr, what)                                              \
  do {                                                                     \
    CUresult r_ = (expr);                                                  \
    if (r_ != CUDA_SUCCESS) {                                              \
      err = Prefix(call, 0) + ": " what " failed during autotuning: " +    \
            CudaErrorString(api, r_);                                      \
      goto cleanup;                                                        \
    }                                                                      \
  } while (0)

// Times every loadable config on the real buffers, restoring the inputs the
// kernel overwrites before each run, and keeps the fastest. Must not run
// under stream capture (it synchronizes).
std::string Autotune(const DriverApi* api, KernelCall& call, LoadedCall& l,
                     CUstream stream, const CallBuffers& b) {
  constexpr int kWarmup = 1, kReps = 5;
  std::string err;
  std::vector<CUdeviceptr> saved(call.aliased_inputs.size(), 0);
  std::vector<float> times(call.configs.size(), -1.0f);
  CUevent start = nullptr, stop = nullptr;
  auto restore = [&]() -> CUresult {
    for (size_t i = 0; i < saved.size(); ++i) {
      int64_t k = call.aliased_inputs[i];
      CUresult r =
          api->cuMemcpyDtoDAsync(b.ptrs[k], saved[i], b.sizes[k], stream);
      if (r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
  };
  JKR_CHECK(api->cuEventCreate(&start, 0), "cuEventCreate");
  JKR_CHECK(api->cuEventCreate(&stop, 0), "cuEventCreate");
  for (size_t i = 0; i < saved.size(); ++i) {
    int64_t k = call.aliased_inputs[i];
    JKR_CHECK(api->cuMemAlloc(&saved[i], std::max<size_t>(b.sizes[k], 1)),
              "cuMemAlloc");
    JKR_CHECK(api->cuMemcpyDtoDAsync(saved[i], b.ptrs[k], b.sizes[k], stream),
              "saving an aliased input");
  }
  for (size_t c = 0; c < call.configs.size(); ++c) {
    if (l.functions[c] == nullptr) continue;
    std::vector<float> reps;
    for (int rep = 0; rep < kWarmup + kReps; ++rep) {
      JKR_CHECK(restore(), "restoring an aliased input");
      err = ZeroOutputs(api, call, stream, b);
      if (!err.empty()) goto cleanup;
      JKR_CHECK(api->cuEventRecord(start, stream), "cuEventRecord");
      if (!Launch(api, call, c, l.functions[c], stream, b).empty()) break;
      JKR_CHECK(api->cuEventRecord(stop, stream), "cuEventRecord");
      JKR_CHECK(api->cuEventSynchronize(stop), "running a candidate config");
      float ms = 0;
      JKR_CHECK(api->cuEventElapsedTime(&ms, start, stop), "timing");
      if (rep >= kWarmup) reps.push_back(ms);
    }
    if (reps.size() == kReps) {
      std::sort(reps.begin(), reps.end());
      times[c] = reps[kReps / 2];
    }
  }
  JKR_CHECK(restore(), "restoring an aliased input");
  {
    int best = -1;
    for (size_t c = 0; c < times.size(); ++c) {
      if (times[c] >= 0 && (best < 0 || times[c] < times[best])) best = c;
    }
    if (best < 0) {
      err = Prefix(call, 0) + ": no configuration could be launched";
      goto cleanup;
    }
    l.chosen = best;
    CUdevice device = 0;
    api->cuCtxGetDevice(&device);
    std::lock_guard<std::mutex> lock(tune_records_mu);
    TuneRecordStore().push_back({call.tune_key, device, best, times});
  }
cleanup:
  // The saved copies may still be read by queued copies: wait before freeing.
  api->cuStreamSynchronize(stream);
  for (CUdeviceptr p : saved) {
    if (p != 0) api->cuMemFree(p);
  }
  if (start != nullptr) api->cuEventDestroy(start);
  if (stop != nullptr) api->cuEventDestroy(stop);
  return err;
}

}  // namespace

uint64_t HashBytes(const uint8_t* data, size_t size) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (size_t i = 0; i < size; ++i) h = (h ^ data[i]) * 1099511628211ull;
  return h;
}

int64_t ScratchBytes(const KernelConfig& cfg) {
  int64_t programs = int64_t{cfg.grid[0]} * cfg.grid[1] * cfg.grid[2] * cfg.cluster[0] *
                     cfg.cluster[1] * cfg.cluster[2];
  return AlignUp(programs * cfg.global_scratch_bytes, kScratchAlign) +
         AlignUp(programs * cfg.profile_scratch_bytes, kScratchAlign);
}

// The driver and the context that owns `stream`, or "" with an error set.
static std::string StreamContext(const KernelCall& call, CUstream stream,
                                 const DriverApi** api, CUcontext* ctx) {
  std::string err;
  *api = GetDriver(&err);
  if (*api == nullptr) return Prefix(call, 0) + ": " + err;
  CUresult r = (*api)->cuStreamGetCtx(stream, ctx);
  if (r != CUDA_SUCCESS) {
    return Prefix(call, 0) + ": cuStreamGetCtx failed: " +
           CudaErrorString(*api, r);
  }
  return "";
}

std::string PrepareCall(KernelCall& call, CUstream stream) {
  const DriverApi* api = nullptr;
  CUcontext ctx = nullptr;
  std::string err = StreamContext(call, stream, &api, &ctx);
  if (!err.empty()) return err;
  ScopedContext scope(api, ctx);
  FindOrLoad(call, api, ctx, &err);
  return err;
}

// Launches issued directly on a stream vs recorded into a CUDA graph being
// captured (XLA command buffers): how tests and benchmarks see capture.
static std::atomic<uint64_t> direct_launches{0};
static std::atomic<uint64_t> captured_launches{0};

std::string ExecuteCall(KernelCall& call, CUstream stream,
                        const CallBuffers& b) {
  const DriverApi* api = nullptr;
  CUcontext ctx = nullptr;
  std::string err = StreamContext(call, stream, &api, &ctx);
  if (!err.empty()) return err;
  for (const Param& p : call.params) {
    if (!p.is_buffer) continue;
    CUdeviceptr ptr = b.ptrs[p.operand];
    if (p.alignment > 1 && ptr % p.alignment != 0) {
      char addr[32];
      std::snprintf(addr, sizeof(addr), "0x%" PRIx64, uint64_t{ptr});
      return Prefix(call, 0) + ": operand " + std::to_string(p.operand) +
             " is at address " + addr + ", which is not aligned to the " +
             std::to_string(p.alignment) +
             " bytes the kernel was compiled to assume";
    }
  }
  ScopedContext scope(api, ctx);
  LoadedCall* l = FindOrLoad(call, api, ctx, &err);
  if (l == nullptr) return err;
  int capture = CU_STREAM_CAPTURE_STATUS_NONE;
  api->cuStreamIsCapturing(stream, &capture);
  int chosen = l->chosen.load(std::memory_order_acquire);
  if (chosen < 0) {
    if (capture == CU_STREAM_CAPTURE_STATUS_NONE) {
      std::lock_guard<std::mutex> lock(l->tune_mu);
      if (l->chosen < 0) {
        err = Autotune(api, call, *l, stream, b);
        if (!err.empty()) return err;
      }
      chosen = l->chosen;
    } else {
      // Timing is impossible while a CUDA graph is being captured: use the
      // first loadable config now and tune at the next uncaptured execution.
      for (size_t c = 0; c < l->functions.size() && chosen < 0; ++c) {
        if (l->functions[c] != nullptr) chosen = static_cast<int>(c);
      }
    }
  }
  err = ZeroOutputs(api, call, stream, b);
  if (!err.empty()) return err;
  err = Launch(api, call, chosen, l->functions[chosen], stream, b);
  if (err.empty()) {
    (capture == CU_STREAM_CAPTURE_STATUS_NONE ? direct_launches : captured_launches)
        .fetch_add(1, std::memory_order_relaxed);
  }
  return err;
}

LaunchCounts GetLaunchCounts() {
  return {direct_launches.load(std::memory_order_relaxed),
          captured_launches.load(std::memory_order_relaxed)};
}

std::vector<TuneRecord> TuneRecords() {
  std::lock_guard<std::mutex> lock(tune_records_mu);
  return TuneRecordStore();
}

}  // namespace jkr
