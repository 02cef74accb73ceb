// Python entry point of latentfast._C. The ops' schemas are declared in latentfast/_ops.py;
// the kernels in csrc/cpu and csrc/cuda register themselves with TORCH_LIBRARY_IMPL when this
// shared library is loaded, so the module itself needs no Python functions.
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "latentfast compiled kernels (registered with torch.ops.latentfast)", -1, nullptr};
  return PyModule_Create(&module_def);
}
}
