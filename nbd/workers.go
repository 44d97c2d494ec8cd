package nbd

// This file holds the worker pool of a connection: admitted requests are
// handed to an idle worker goroutine, or to a new one when none waits.

// job is one admitted request for a worker.
type job struct {
	req     request
	payload []byte
	weight  int64
	shared  bool
}

// dispatch runs j on an idle worker, or on a new one when none waits.
// There are never more workers than requests in service at the peak,
// which the budget bounds.
func (t *transmission) dispatch(j job) {
	t.handlers.Add(1)
	select {
	case t.jobs <- j:
	default:
		go t.worker(j)
	}
}

// worker serves j, then further jobs, until the connection is done.
func (t *transmission) worker(j job) {
	for {
		t.handle(j.req, j.payload, j.weight, j.shared)
		select {
		case j = <-t.jobs:
		case <-t.done:
			return
		}
	}
}
