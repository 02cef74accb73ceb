// Python entry point of latentfast._C. The ops' schemas are declared in latentfast/_ops.py; the
// kernels in csrc/cpu and csrc/cuda register themselves on latentfast_compiled::* with
// TORCH_LIBRARY_IMPL when this shared library is loaded. The module itself holds one string:
// the configuration it was built with (written by setup.py).
#include <Python.h>

#include "latentfast_build_info.h"

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "latentfast compiled kernels (registered on torch.ops.latentfast_compiled)", -1,
      nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr && PyModule_AddStringConstant(module, "BUILD_INFO", LATENTFAST_BUILD_INFO) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
}
