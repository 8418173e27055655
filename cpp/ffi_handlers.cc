// XLA FFI handlers of the `jax_kernel_runtime_launch` target (platform CUDA).
//
// instantiate: parse the attributes into a KernelCall (no device access)
// initialize:  load the kernel images into the stream's context (outside any
//              CUDA-graph capture)
// execute:     zero outputs, autotune on first use, launch; command-buffer
//              compatible because it always enqueues the same operations.
#include "ffi_handlers.h"

#include <string>
#include <string_view>

#include "kernel_runtime.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jkr {

struct KernelCallState : KernelCall {
  static ffi::TypeId id;
};
ffi::TypeId KernelCallState::id = {};

namespace {

constexpr int kLaunchFields = 12;

ffi::Error Invalid(std::string_view name, std::string message) {
  return ffi::Error::InvalidArgument("jax_kernel_runtime: kernel '" +
                                     std::string(name) + "': " + message);
}

template <typename T>
ffi::ErrorOr<T> Get(const ffi::Dictionary& attrs, std::string_view key,
                    std::string_view name) {
  if (!attrs.contains(key)) {
    return ffi::Unexpected(
        Invalid(name, "missing attribute '" + std::string(key) + "'"));
  }
  return attrs.get<T>(key);
}

std::vector<int64_t> OptionalI64s(const ffi::Dictionary& attrs,
                                  std::string_view key) {
  if (!attrs.contains(key)) return {};
  auto span = attrs.get<ffi::Span<const int64_t>>(key);
  if (!span.has_value()) return {};
  return std::vector<int64_t>(span->begin(), span->end());
}

#define JKR_ASSIGN(lhs, expr)                          \
  auto lhs##_or = (expr);                              \
  if (!lhs##_or.has_value()) return ffi::Unexpected(lhs##_or.error()); \
  auto lhs = *lhs##_or

ffi::ErrorOr<std::unique_ptr<KernelCallState>> Instantiate(
    ffi::Dictionary attrs) {
  auto call = std::make_unique<KernelCallState>();
  std::string_view name = "?";
  if (attrs.contains("name")) {
    auto n = attrs.get<std::string_view>("name");
    if (n.has_value()) name = *n;
  }
  call->name = std::string(name);
  if (attrs.contains("tune_key")) {
    auto k = attrs.get<std::string_view>("tune_key");
    if (k.has_value()) call->tune_key = std::string(*k);
  }
  JKR_ASSIGN(kinds, (Get<ffi::Span<const int64_t>>(attrs, "param_kinds", name)));
  JKR_ASSIGN(values,
             (Get<ffi::Span<const int64_t>>(attrs, "param_values", name)));
  JKR_ASSIGN(aligns, (Get<ffi::Span<const int64_t>>(attrs, "param_align", name)));
  if (values.size() != kinds.size() || aligns.size() != kinds.size()) {
    return ffi::Unexpected(Invalid(name, "param_kinds, param_values and param_align differ in length"));
  }
  for (size_t i = 0; i < kinds.size(); ++i) {
    Param p;
    p.is_buffer = kinds[i] == 0;
    if (p.is_buffer) {
      p.operand = values[i];
      p.alignment = aligns[i];
    } else if (kinds[i] == 1 || kinds[i] == 2 || kinds[i] == 4 || kinds[i] == 8) {
      p.size = static_cast<int>(kinds[i]);
      p.bits = static_cast<uint64_t>(values[i]);
    } else {
      return ffi::Unexpected(Invalid(name, "parameter " + std::to_string(i) +
                               " has an unknown kind " + std::to_string(kinds[i])));
    }
    call->params.push_back(p);
  }
  call->zeroed_outputs = OptionalI64s(attrs, "zeroed_outputs");
  call->aliased_inputs = OptionalI64s(attrs, "aliased_inputs");
  if (attrs.contains("scratch_output")) {
    JKR_ASSIGN(scratch, attrs.get<int64_t>("scratch_output"));
    call->scratch_output = scratch != 0;
  }
  JKR_ASSIGN(num_configs, (Get<int64_t>(attrs, "num_configs", name)));
  if (num_configs < 1) return ffi::Unexpected(Invalid(name, "a call needs at least one config"));
  for (int64_t c = 0; c < num_configs; ++c) {
    std::string suffix = "_" + std::to_string(c);
    KernelConfig cfg;
    JKR_ASSIGN(image,
               (Get<ffi::Span<const uint8_t>>(attrs, "image" + suffix, name)));
    JKR_ASSIGN(function,
               (Get<std::string_view>(attrs, "function" + suffix, name)));
    JKR_ASSIGN(launch,
               (Get<ffi::Span<const int64_t>>(attrs, "launch" + suffix, name)));
    if (image.size() == 0) return ffi::Unexpected(Invalid(name, "config has an empty image"));
    // A config's own grid wins over the call's (autotuned block sizes).
    std::string grid_key = attrs.contains("grid" + suffix) ? "grid" + suffix : "grid";
    JKR_ASSIGN(grid, (Get<ffi::Span<const int64_t>>(attrs, grid_key, name)));
    if (grid.size() != 3) return ffi::Unexpected(Invalid(name, grid_key + " must have 3 entries"));
    for (int i = 0; i < 3; ++i) {
      int64_t limit = i == 0 ? 2147483647 : 65535;
      if (grid[i] < 1 || grid[i] > limit) {
        return ffi::Unexpected(Invalid(name, grid_key + " entry " + std::to_string(i) + " is " +
                                 std::to_string(grid[i]) + ", outside [1, " +
                                 std::to_string(limit) + "]"));
      }
      cfg.grid[i] = static_cast<uint32_t>(grid[i]);
    }
    if (launch.size() != kLaunchFields) {
      return ffi::Unexpected(Invalid(name, "launch" + suffix + " must have " +
                               std::to_string(kLaunchFields) + " entries"));
    }
    cfg.image.assign(image.begin(), image.end());
    cfg.image_hash = HashBytes(cfg.image.data(), cfg.image.size());
    cfg.function = std::string(function);
    for (int i = 0; i < 3; ++i) {
      cfg.block[i] = static_cast<uint32_t>(launch[i]);
      cfg.cluster[i] = static_cast<uint32_t>(launch[4 + i]);
      if (launch[i] < 1 || launch[4 + i] < 1) {
        return ffi::Unexpected(Invalid(name, "block and cluster entries must be >= 1"));
      }
    }
    cfg.shared_bytes = static_cast<uint32_t>(launch[3]);
    cfg.global_scratch_bytes = launch[7];
    cfg.profile_scratch_bytes = launch[8];
    cfg.scratch_params = launch[9] != 0;
    cfg.cooperative = launch[10] != 0;
    cfg.pdl = launch[11] != 0;
    call->configs.push_back(std::move(cfg));
  }
  return call;
}

ffi::Error Initialize(CUstream stream, KernelCallState* call) {
  std::string err = PrepareCall(*call, stream);
  if (!err.empty()) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

ffi::Error Execute(CUstream stream, KernelCallState* call,
                   ffi::RemainingArgs args, ffi::RemainingRets rets) {
  constexpr size_t kInline = 32;
  size_t num_in = args.size();
  size_t num_out = rets.size() - (call->scratch_output ? 1 : 0);
  size_t n = num_in + num_out;
  CUdeviceptr inline_ptrs[kInline];
  size_t inline_sizes[kInline];
  std::vector<CUdeviceptr> heap_ptrs;
  std::vector<size_t> heap_sizes;
  CUdeviceptr* ptrs = inline_ptrs;
  size_t* sizes = inline_sizes;
  if (n > kInline) {
    heap_ptrs.resize(n), heap_sizes.resize(n);
    ptrs = heap_ptrs.data(), sizes = heap_sizes.data();
  }
  for (size_t i = 0; i < num_in; ++i) {
    auto buf = args.get<ffi::AnyBuffer>(i);
    if (!buf.has_value()) return buf.error();
    ptrs[i] = reinterpret_cast<CUdeviceptr>(buf->untyped_data());
    sizes[i] = buf->size_bytes();
  }
  for (size_t i = 0; i < num_out; ++i) {
    auto buf = rets.get<ffi::AnyBuffer>(i);
    if (!buf.has_value()) return buf.error();
    ptrs[num_in + i] = reinterpret_cast<CUdeviceptr>((*buf)->untyped_data());
    sizes[num_in + i] = (*buf)->size_bytes();
  }
  for (const Param& p : call->params) {
    if (p.is_buffer && (p.operand < 0 || static_cast<size_t>(p.operand) >= n)) {
      return Invalid(call->name, "parameter refers to operand " +
                                     std::to_string(p.operand) + " but the call has " +
                                     std::to_string(n));
    }
  }
  CallBuffers b{ptrs, sizes, num_in, num_out, 0, 0};
  if (call->scratch_output) {
    auto buf = rets.get<ffi::AnyBuffer>(rets.size() - 1);
    if (!buf.has_value()) return buf.error();
    b.scratch = reinterpret_cast<CUdeviceptr>((*buf)->untyped_data());
    b.scratch_size = (*buf)->size_bytes();
  }
  std::string err = ExecuteCall(*call, stream, b);
  if (!err.empty()) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

}  // namespace

// instantiate: attributes only
XLA_FFI_DEFINE_HANDLER_SYMBOL(kLaunchInstantiate, Instantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Attrs<ffi::Dictionary>());  // all attrs

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kLaunchInitialize, Initialize,
    ffi::Ffi::Bind<ffi::ExecutionStage::kInitialize>()
        .Ctx<ffi::PlatformStream<CUstream>>()  // XLA's stream
        .Ctx<ffi::State<KernelCallState>>());  // from instantiate

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    kLaunchExecute, Execute,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<CUstream>>()  // XLA's stream
        .Ctx<ffi::State<KernelCallState>>()    // from instantiate
        .RemainingArgs()                       // inputs
        .RemainingRets(),                      // outputs (+ scratch)
    {ffi::Traits::kCmdBufferCompatible});

void* LaunchInstantiateHandler() { return reinterpret_cast<void*>(kLaunchInstantiate); }
void* LaunchInitializeHandler() { return reinterpret_cast<void*>(kLaunchInitialize); }
void* LaunchExecuteHandler() { return reinterpret_cast<void*>(kLaunchExecute); }
void* KernelCallTypeId() { return &KernelCallState::id; }
void* KernelCallTypeInfo() {
  static XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<KernelCallState>();
  return &info;
}

}  // namespace jkr
