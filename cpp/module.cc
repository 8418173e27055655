// The one nanobind module of jax-kernel-runtime: FFI capsules for
// registration plus a few introspection helpers. See _jax_kernel_runtime.pyi.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "cuda_driver.h"
#include "ffi_handlers.h"
#include "kernel_runtime.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

NB_MODULE(_jax_kernel_runtime, m) {
  m.doc() = "Native part of jax-kernel-runtime (XLA FFI kernel launcher).";

  m.def("registrations", []() {
    nb::dict stages;
    stages["instantiate"] = nb::capsule(jkr::LaunchInstantiateHandler());
    stages["initialize"] = nb::capsule(jkr::LaunchInitializeHandler());
    stages["execute"] = nb::capsule(jkr::LaunchExecuteHandler());
    nb::dict out;
    out["jax_kernel_runtime_launch"] = stages;
    return out;
  });

  m.def("type_registrations", []() {
    nb::dict reg;
    reg["type_id"] = nb::capsule(jkr::KernelCallTypeId());
    reg["type_info"] = nb::capsule(jkr::KernelCallTypeInfo());
    nb::dict out;
    out["jax_kernel_runtime.KernelCall"] = reg;
    return out;
  });

  m.def("ffi_api_version", []() {
    return std::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  }, "(major, minor) of the XLA FFI headers this module was built against.");

  m.def("driver_error", []() {
    std::string err;
    jkr::GetDriver(&err);
    return err;
  }, "Empty if libcuda.so.1 loads and initializes, else why not.");

  m.def("driver_version", []() {
    std::string err;
    const jkr::DriverApi* api = jkr::GetDriver(&err);
    if (api == nullptr) throw std::runtime_error(err);
    int version = 0;
    api->cuDriverGetVersion(&version);
    return version;
  });

  m.def("tune_records", []() {
    std::vector<std::tuple<std::string, int, int, std::vector<float>>> out;
    for (const auto& r : jkr::TuneRecords()) {
      out.emplace_back(r.key, r.device, r.chosen, r.times_ms);
    }
    return out;
  }, "(tune_key, device, chosen config, per-config median ms) per tuning.");

  m.def("launch_counts", []() {
    jkr::LaunchCounts c = jkr::GetLaunchCounts();
    return std::make_tuple(c.direct, c.captured);
  }, "(direct, captured): launches issued on a stream vs recorded into a CUDA graph.");

  m.def("hash_image", [](nb::bytes image) {
    return jkr::HashBytes(reinterpret_cast<const uint8_t*>(image.c_str()),
                          image.size());
  });
}
