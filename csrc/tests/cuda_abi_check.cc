// Compiled (never run) wherever the CUDA headers exist: kvtier passes these
// structs and constants to a dlopen'ed runtime, so they must match its ABI.
#include <cuda_runtime_api.h>

#include "core/copy/cuda.h"

static_assert(sizeof(kvtier::cuda::MemcpyAttributes) == sizeof(cudaMemcpyAttributes));
static_assert(sizeof(kvtier::cuda::MemLocation) == sizeof(cudaMemLocation));
static_assert(offsetof(kvtier::cuda::MemcpyAttributes, flags) ==
              offsetof(cudaMemcpyAttributes, flags));
static_assert(sizeof(kvtier::cuda::PointerAttributes) >= sizeof(cudaPointerAttributes));
static_assert(offsetof(kvtier::cuda::PointerAttributes, host_pointer) ==
              offsetof(cudaPointerAttributes, hostPointer));
static_assert(offsetof(kvtier::cuda::PointerAttributes, device) ==
              offsetof(cudaPointerAttributes, device));
static_assert(cudaMemoryTypeDevice == 2 && cudaMemoryTypeManaged == 3);
static_assert(cudaHostRegisterPortable == 1);
static_assert(cudaErrorHostMemoryAlreadyRegistered == 712);
static_assert(cudaErrorIllegalAddress == 700);
static_assert(cudaDevAttrCanUseHostPointerForRegisteredMem == 91);
static_assert(cudaMemcpyDefault == 4);
static_assert(cudaErrorNotReady == 600);
static_assert(cudaStreamNonBlocking == 1);
static_assert(cudaEventDisableTiming == 2);
static_assert(cudaMemcpySrcAccessOrderStream == 1);
static_assert(sizeof(cudaError_t) == sizeof(kvtier::cuda::Err));
