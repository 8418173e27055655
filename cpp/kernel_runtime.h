// Launching a compiled kernel image on a CUDA stream: the launch descriptor,
// the per-(image, context) module cache, autotuning and the launch itself.
// Nothing here knows about XLA; ffi_handlers.cc adapts it to the XLA FFI.
#ifndef JAX_KERNEL_RUNTIME_KERNEL_RUNTIME_H_
#define JAX_KERNEL_RUNTIME_KERNEL_RUNTIME_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_driver.h"

namespace jkr {

// One compiled configuration of a kernel (for autotuning a call carries
// several). Mirrors jax_kernel_runtime.KernelConfig on the Python side.
struct KernelConfig {
  uint32_t grid[3] = {1, 1, 1};  // in programs (clusters of CTAs); per config
                                 // because Triton grids depend on block sizes
  std::string function;        // symbol name inside the image
  std::vector<uint8_t> image;  // cubin; copied so it outlives the attributes
  uint64_t image_hash = 0;     // key of the process-wide module cache
  uint32_t block[3] = {1, 1, 1};
  uint32_t shared_bytes = 0;  // dynamic shared memory per block
  uint32_t cluster[3] = {1, 1, 1};
  int64_t global_scratch_bytes = 0;  // per program (Triton's global scratch)
  int64_t profile_scratch_bytes = 0;
  bool scratch_params = false;  // Triton appends two trailing scratch pointers
  bool cooperative = false;
  bool pdl = false;  // programmatic dependent launch
};

// One kernel parameter, in order: either a buffer operand (inputs first, then
// outputs) or a scalar baked into the call (little-endian bits, 1-8 bytes).
struct Param {
  bool is_buffer = true;
  int64_t operand = 0;    // buffer: index into inputs ++ outputs
  int64_t alignment = 1;  // buffer: the alignment the kernel assumes
  int size = 0;           // scalar: byte width
  uint64_t bits = 0;      // scalar: value
};

// What was loaded for one CUDA context (one device).
struct LoadedCall {
  CUcontext ctx = nullptr;
  std::vector<CUfunction> functions;  // nullptr where a config failed to load
  std::vector<std::string> errors;    // why, per config
  std::atomic<int> chosen{-1};        // autotuned (or only) config
  std::mutex tune_mu;
};

// Everything a call site needs, parsed once at instantiation.
struct KernelCall {
  std::string name;      // user-facing kernel name, used in every error
  std::string tune_key;  // identifies the call for recorded autotune results
  std::vector<KernelConfig> configs;
  std::vector<Param> params;
  std::vector<int64_t> zeroed_outputs;
  std::vector<int64_t> aliased_inputs;  // inputs the kernel overwrites
  bool scratch_output = false;  // the last result is the scratch buffer

  std::mutex mu;  // guards `loaded`
  std::deque<std::unique_ptr<LoadedCall>> loaded;
};

// Operand buffers of one execution: inputs then outputs (scratch excluded).
struct CallBuffers {
  const CUdeviceptr* ptrs;
  const size_t* sizes;
  size_t num_inputs;
  size_t num_outputs;
  CUdeviceptr scratch;  // 0 when the call has no scratch output
  size_t scratch_size;
};

// Loads the modules for the context that owns `stream`. Safe to call often.
std::string PrepareCall(KernelCall& call, CUstream stream);

// Zeroes outputs, autotunes on first use (outside stream capture) and
// launches the chosen config. Returns "" on success, else the error message.
std::string ExecuteCall(KernelCall& call, CUstream stream,
                        const CallBuffers& buffers);

// Scratch bytes a config needs for a grid: global then profile scratch, each
// 256-byte aligned. The Python side computes the same figure.
int64_t ScratchBytes(const KernelConfig& config);

struct TuneRecord {
  std::string key;
  int device;
  int chosen;
  std::vector<float> times_ms;  // per config; negative where it failed
};
std::vector<TuneRecord> TuneRecords();

struct LaunchCounts {
  uint64_t direct;    // launched straight onto a stream
  uint64_t captured;  // recorded while the stream captured a CUDA graph
};
LaunchCounts GetLaunchCounts();

uint64_t HashBytes(const uint8_t* data, size_t size);

}  // namespace jkr

#endif  // JAX_KERNEL_RUNTIME_KERNEL_RUNTIME_H_
