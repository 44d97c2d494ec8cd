package main

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"time"
)

// report prints one line per event and per check, and counts them.
//
// Safe for concurrent use.
type report struct {
	start time.Time

	mu        sync.Mutex
	w         io.Writer
	events    map[string]int
	checks    map[string][2]int // kind → {passed, failed}
	explained map[string]int
	failures  []string
}

func newReport(w io.Writer) *report {
	return &report{start: time.Now(), w: w, events: map[string]int{}, checks: map[string][2]int{}, explained: map[string]int{}}
}

func (r *report) line(kind, what, format string, args ...any) string {
	now := time.Now()
	l := fmt.Sprintf("%s +%6.1fs %-5s %-28s %s", now.UTC().Format("15:04:05.000"), now.Sub(r.start).Seconds(), kind, what, fmt.Sprintf(format, args...))
	fmt.Fprintln(r.w, l)
	return l
}

// info prints a line that is neither an event nor a check.
func (r *report) info(what, format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.line("INFO", what, format, args...)
}

// event records an event the driver caused.
func (r *report) event(what, format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events[what]++
	r.line("EVENT", what, format, args...)
}

// check records a check and whether it passed.
func (r *report) check(what string, ok bool, format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.checks[what]
	kind := "CHECK"
	if ok {
		c[0]++
	} else {
		c[1]++
		kind = "FAIL"
	}
	r.checks[what] = c
	l := r.line(kind, what, format, args...)
	if !ok {
		r.failures = append(r.failures, l)
	}
}

// expected records an error the chaos explains (a client whose own node
// was down).
func (r *report) expected(what, format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.explained[what]++
	r.line("NOTE", what, format, args...)
}

// summary prints the counts and the failures, and returns how many
// failures there were.
func (r *report) summary(header string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "\n=== summary: %s; %s\n", header, time.Since(r.start).Round(time.Second))
	keys := func(m map[string]int) []string {
		var k []string
		for x := range m {
			k = append(k, x)
		}
		slices.Sort(k)
		return k
	}
	total := 0
	for _, k := range keys(r.events) {
		total += r.events[k]
	}
	fmt.Fprintf(&b, "events: %d\n", total)
	for _, k := range keys(r.events) {
		fmt.Fprintf(&b, "  %-32s %d\n", k, r.events[k])
	}
	fmt.Fprintf(&b, "checks: (passed / failed)\n")
	var ck []string
	for k := range r.checks {
		ck = append(ck, k)
	}
	slices.Sort(ck)
	for _, k := range ck {
		fmt.Fprintf(&b, "  %-32s %d / %d\n", k, r.checks[k][0], r.checks[k][1])
	}
	fmt.Fprintf(&b, "explained errors:\n")
	for _, k := range keys(r.explained) {
		fmt.Fprintf(&b, "  %-32s %d\n", k, r.explained[k])
	}
	fmt.Fprintf(&b, "failures: %d\n", len(r.failures))
	for _, f := range r.failures {
		fmt.Fprintf(&b, "  %s\n", f)
	}
	fmt.Fprint(r.w, b.String())
	return len(r.failures)
}
