#include "cuda_driver.h"

#include <dlfcn.h>

#include <mutex>

namespace jkr {
namespace {

struct LoadResult {
  DriverApi api{};
  bool ok = false;
  std::string error;
};

template <typename Fn>
bool Resolve(void* lib, const char* name, Fn* slot, std::string* error) {
  *slot = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*slot == nullptr) {
    *error = std::string("libcuda.so.1 has no symbol ") + name +
             " (the CUDA driver is too old for jax-kernel-runtime)";
    return false;
  }
  return true;
}

LoadResult Load() {
  LoadResult r;
  // RTLD_NOLOAD first: inside a JAX process with a GPU, XLA already opened the
  // driver, and we want exactly that copy.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    r.error = std::string("cannot load the CUDA driver libcuda.so.1 (") +
              (why ? why : "unknown dlopen error") +
              "); running a kernel through jax-kernel-runtime needs an "
              "NVIDIA GPU and its driver";
    return r;
  }
  DriverApi& a = r.api;
  std::string& e = r.error;
  bool ok = Resolve(lib, "cuInit", &a.cuInit, &e) &&
            Resolve(lib, "cuDriverGetVersion", &a.cuDriverGetVersion, &e) &&
            Resolve(lib, "cuGetErrorName", &a.cuGetErrorName, &e) &&
            Resolve(lib, "cuGetErrorString", &a.cuGetErrorString, &e) &&
            Resolve(lib, "cuStreamGetCtx", &a.cuStreamGetCtx, &e) &&
            Resolve(lib, "cuCtxGetCurrent", &a.cuCtxGetCurrent, &e) &&
            Resolve(lib, "cuCtxPushCurrent_v2", &a.cuCtxPushCurrent, &e) &&
            Resolve(lib, "cuCtxPopCurrent_v2", &a.cuCtxPopCurrent, &e) &&
            Resolve(lib, "cuCtxGetDevice", &a.cuCtxGetDevice, &e) &&
            Resolve(lib, "cuDeviceGetAttribute", &a.cuDeviceGetAttribute, &e) &&
            Resolve(lib, "cuModuleLoadData", &a.cuModuleLoadData, &e) &&
            Resolve(lib, "cuModuleGetFunction", &a.cuModuleGetFunction, &e) &&
            Resolve(lib, "cuFuncSetAttribute", &a.cuFuncSetAttribute, &e) &&
            Resolve(lib, "cuFuncGetAttribute", &a.cuFuncGetAttribute, &e) &&
            Resolve(lib, "cuLaunchKernel", &a.cuLaunchKernel, &e) &&
            Resolve(lib, "cuLaunchKernelEx", &a.cuLaunchKernelEx, &e) &&
            Resolve(lib, "cuMemsetD8Async", &a.cuMemsetD8Async, &e) &&
            Resolve(lib, "cuMemcpyDtoDAsync_v2", &a.cuMemcpyDtoDAsync, &e) &&
            Resolve(lib, "cuMemAlloc_v2", &a.cuMemAlloc, &e) &&
            Resolve(lib, "cuMemFree_v2", &a.cuMemFree, &e) &&
            Resolve(lib, "cuEventCreate", &a.cuEventCreate, &e) &&
            Resolve(lib, "cuEventRecord", &a.cuEventRecord, &e) &&
            Resolve(lib, "cuEventSynchronize", &a.cuEventSynchronize, &e) &&
            Resolve(lib, "cuEventElapsedTime", &a.cuEventElapsedTime, &e) &&
            Resolve(lib, "cuEventDestroy_v2", &a.cuEventDestroy, &e) &&
            Resolve(lib, "cuStreamSynchronize", &a.cuStreamSynchronize, &e) &&
            Resolve(lib, "cuStreamIsCapturing", &a.cuStreamIsCapturing, &e);
  if (!ok) return r;
  CUresult init = a.cuInit(0);
  if (init != CUDA_SUCCESS) {
    r.error = "cuInit failed: " + CudaErrorString(&a, init);
    return r;
  }
  r.ok = true;
  return r;
}

}  // namespace

const DriverApi* GetDriver(std::string* error) {
  // A function-local static is initialized exactly once, thread-safely.
  static const LoadResult* result = new LoadResult(Load());
  if (!result->ok) {
    if (error != nullptr) *error = result->error;
    return nullptr;
  }
  return &result->api;
}

std::string CudaErrorString(const DriverApi* api, CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (api != nullptr) {
    api->cuGetErrorName(result, &name);
    api->cuGetErrorString(result, &text);
  }
  std::string out = name ? name : "CUDA_ERROR_" + std::to_string(result);
  if (text != nullptr) out += std::string(" (") + text + ")";
  return out;
}

}  // namespace jkr
