package block

// Wrapper is implemented by a device that adds behaviour on top of
// another (a cache mode, a discard policy, request metrics). Unwrap
// returns the device beneath.
//
// A wrapper implements only the methods of Device it changes, and never
// forwards an optional interface (NoWaitReader, Mapper, an engine's own
// operations) by hand: callers find those with As, which looks through
// every wrapper. A wrapper that must change an optional method's meaning
// (metrics that count ReadNoWait) implements it, and As finds its
// version first.
type Wrapper interface {
	Unwrap() Device
}

// As returns the first device in d's chain of wrappers, d itself
// first, that implements T, on the model of errors.As and net/http's
// ResponseController. It reports false when none does.
func As[T any](d Device) (T, bool) {
	for d != nil {
		if t, ok := d.(T); ok {
			return t, true
		}
		w, ok := d.(Wrapper)
		if !ok {
			break
		}
		d = w.Unwrap()
	}
	var zero T
	return zero, false
}
