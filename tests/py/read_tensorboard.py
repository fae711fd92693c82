"""Read a TensorBoard log directory with TensorBoard's own reader and print its scalars.

Usage: python read_tensorboard.py LOGDIR

Prints {"files": [names], "scalars": {tag: [[step, value, wall_time], ...]}} as JSON. Every
record is first read with TensorBoard's record reader, which raises on a bad CRC or a truncated
record (EventAccumulator would stop there without a word); then the scalars are those
EventAccumulator, what `tensorboard --logdir` uses, finds.
"""

import json
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New
from tensorboard.compat.tensorflow_stub import errors

logdir = sys.argv[1]
files = sorted(f for f in os.listdir(logdir) if ".tfevents." in f)
records = 0
for name in files:
    reader = PyRecordReader_New(os.path.join(logdir, name))
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            break
        event_pb2.Event.FromString(reader.record())
        records += 1

acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
acc.Reload()
scalars = {
    tag: [[e.step, e.value, e.wall_time] for e in acc.Scalars(tag)]
    for tag in acc.Tags()["scalars"]
}
print(json.dumps({"files": files, "records": records, "scalars": scalars}))
