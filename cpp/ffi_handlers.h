// Opaque pointers to the FFI handlers and the state type, for module.cc, so
// the nanobind module needs no XLA headers.
#ifndef JAX_KERNEL_RUNTIME_FFI_HANDLERS_H_
#define JAX_KERNEL_RUNTIME_FFI_HANDLERS_H_

namespace jkr {

void* LaunchInstantiateHandler();
void* LaunchInitializeHandler();
void* LaunchExecuteHandler();
void* KernelCallTypeId();    // XLA_FFI_TypeId*
void* KernelCallTypeInfo();  // XLA_FFI_TypeInfo*

}  // namespace jkr

#endif  // JAX_KERNEL_RUNTIME_FFI_HANDLERS_H_
