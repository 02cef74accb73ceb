// Releases the GIL for its lifetime when the calling thread holds it (a direct call from Python
// through torch.ops); does nothing when called from a thread that does not (e.g. torch.compile).
#pragma once

#include <Python.h>

namespace latentfast {

class GilRelease {
 public:
  GilRelease() : state_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~GilRelease() {
    if (state_) PyEval_RestoreThread(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace latentfast
