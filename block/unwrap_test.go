package block

import "testing"

// The devices of TestAs embed a nil Device for its method set: As only
// asserts types and calls Unwrap, never a Device method.

// asLeaf is a device at the bottom of a chain, with a capability.
type asLeaf struct {
	Device
	served bool // what its ReadNoWait answers
}

func (l *asLeaf) ReadNoWait(p []byte, off int64) bool { return l.served }

// asWrapper adds nothing but Unwrap.
type asWrapper struct{ Device }

func (w *asWrapper) Unwrap() Device { return w.Device }

// asIntercept is a wrapper that changes the capability's meaning (as
// metrics counts ReadNoWait): it answers the opposite of the device
// beneath.
type asIntercept struct{ Device }

func (w *asIntercept) Unwrap() Device { return w.Device }
func (w *asIntercept) ReadNoWait(p []byte, off int64) bool {
	return !ReadNoWait(w.Device, p, off)
}

// asOpaque embeds a device but is no Wrapper: what is beneath it is
// hidden.
type asOpaque struct{ Device }

func TestAs(t *testing.T) {
	leaf := &asLeaf{served: true}
	inner := &asWrapper{leaf}
	outer := &asWrapper{&asWrapper{inner}}
	icept := &asIntercept{inner}
	overIcept := &asWrapper{icept}
	opaque := &asWrapper{&asOpaque{leaf}}
	dangling := &asWrapper{} // Unwrap returns nil

	for _, tc := range []struct {
		name      string
		d         Device
		nowait    NoWaitReader // what As[NoWaitReader] finds, nil for none
		leaf      *asLeaf      // what As[*asLeaf] finds
		wrapper   *asWrapper   // what As[*asWrapper] finds
		readsNoWt bool         // what ReadNoWait(d) answers
	}{
		{name: "nil", d: nil},
		{name: "leaf", d: leaf, nowait: leaf, leaf: leaf, readsNoWt: true},
		{name: "one wrapper", d: inner, nowait: leaf, leaf: leaf, wrapper: inner, readsNoWt: true},
		{name: "three wrappers", d: outer, nowait: leaf, leaf: leaf, wrapper: outer, readsNoWt: true},
		// The intercepting wrapper is found first, and the leaf
		// beneath it is still found by its own type.
		{name: "intercept", d: icept, nowait: icept, leaf: leaf, wrapper: inner, readsNoWt: false},
		{name: "over intercept", d: overIcept, nowait: icept, leaf: leaf, wrapper: overIcept, readsNoWt: false},
		{name: "opaque", d: opaque, wrapper: opaque},
		{name: "dangling", d: dangling, wrapper: dangling},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nr, ok := As[NoWaitReader](tc.d)
			if nr != tc.nowait || ok != (tc.nowait != nil) {
				t.Errorf("As[NoWaitReader] = %v, %v, want %v", nr, ok, tc.nowait)
			}
			l, ok := As[*asLeaf](tc.d)
			if l != tc.leaf || ok != (tc.leaf != nil) {
				t.Errorf("As[*asLeaf] = %p, %v, want %p", l, ok, tc.leaf)
			}
			w, ok := As[*asWrapper](tc.d)
			if w != tc.wrapper || ok != (tc.wrapper != nil) {
				t.Errorf("As[*asWrapper] = %p, %v, want %p", w, ok, tc.wrapper)
			}
			if _, ok := As[Mapper](tc.d); ok {
				t.Error("As[Mapper] found a capability no device in the chain has")
			}
			if got := ReadNoWait(tc.d, nil, 0); got != tc.readsNoWt {
				t.Errorf("ReadNoWait = %v, want %v", got, tc.readsNoWt)
			}
		})
	}
}
