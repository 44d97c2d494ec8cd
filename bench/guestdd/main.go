// Command guestdd runs Sheepdog's 2013 direct-write experiment in a real
// guest (internal/guest): `dd of=/dev/vda bs=1M count=100 oflag=direct`,
// RUNS times per mode, against NBD exports of an ovis cluster, and prints
// each run's MB/s with what reached the nodes (their metrics, read
// between the runs). bench/guest-dd.sh starts the cluster and calls it.
//
// The modes, each its own guest boot:
//
//   - writeback: QEMU cache=writeback, the guest's write cache on (its
//     default): plain writes, no flush (dd does not fsync);
//   - emulated: cache=writethrough against an export that does not
//     advertise FUA (ovis node --nbd-no-fua): QEMU sends each write, then
//     a flush;
//   - native: cache=writethrough against an export with FUA: QEMU sends
//     FUA writes.
//
// Sheepdog's dd read /dev/urandom; in a guest under TCG /dev/urandom is
// slower than the disk, so the guest fills a 100 MiB file in its tmpfs
// from /dev/urandom once, before the runs, and every dd reads that.
//
//	guestdd -writeback nbd://H:P/a -emulated nbd://H:P2/b -native nbd://H:P/c \
//	        -metrics H:M1,H:M2,H:M3 -runs 5
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"log"
	"net/http"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ovis-storage/ovis/internal/guest"
)

func main() {
	var (
		uris    = map[string]*string{}
		modes   = []string{"writeback", "emulated", "native"}
		caches  = map[string]string{"writeback": "writeback", "emulated": "writethrough", "native": "writethrough"}
		metrics = flag.String("metrics", "", "the nodes' metrics addresses (HOST:PORT), comma-separated")
		runs    = flag.Int("runs", 5, "dd runs per mode")
		count   = flag.Int("count", 100, "dd's count of 1 MiB blocks per run")
		rounds  = flag.Int("rounds", 1, "boots per mode, interleaved across the modes")
		only    = flag.String("modes", strings.Join(modes, ","), "the modes to run, in this order")
		memMiB  = flag.Int("memory", 512, "the guest's memory in MiB (the random file sits in its tmpfs)")
		console = flag.Bool("console", false, "copy the guest's console to stderr")
	)
	for _, m := range modes {
		uris[m] = flag.String(m, "", "the NBD URI for mode "+m)
	}
	flag.Parse()
	k, err := guest.FindKernel()
	if err != nil {
		log.Fatal(err)
	}
	accel := guest.DefaultAccel(k)
	var addrs []string
	if *metrics != "" {
		addrs = strings.Split(*metrics, ",")
	}
	var results []run
	for r := 0; r < *rounds; r++ {
		for _, m := range strings.Split(*only, ",") {
			if uris[m] == nil || *uris[m] == "" {
				log.Fatalf("guestdd: mode %q: no URI (-%s)", m, m)
			}
			cfg := guest.Config{
				Kernel: k, Script: ddScript(*runs, *count), Drive: *uris[m], Cache: caches[m],
				Accel: accel, MemoryMiB: *memMiB, Timeout: 20 * time.Minute, AnswerTimeout: 10 * time.Minute,
			}
			if *console {
				cfg.Console = os.Stderr
			}
			rs, err := boot(cfg, m, *runs, addrs)
			if err != nil {
				log.Fatalf("guestdd: mode %s, round %d: %v", m, r+1, err)
			}
			results = append(results, rs...)
		}
	}
	fmt.Printf("# guest dd bs=1M count=%d oflag=direct, %d runs per boot, %d boot(s) per mode, accel %s, load %s\n", *count, *runs, *rounds, accel, loadavg())
	printRuns(results)
	printSummary(results)
}

// ddScript is the guest's script: the random file, then RUNS dd runs,
// each between two phases so that the nodes' metrics are read around it.
// Each run is timed with the guest's /proc/uptime and sent as a DD line.
func ddScript(runs, count int) string {
	return fmt.Sprintf(`
t0=$(date +%%s)
dd if=/dev/urandom of=/tmp/r bs=1M count=%[2]d 2>/dev/null
say GEN secs=$(( $(date +%%s) - t0 ))
phase ready cache=$(tr ' ' _ < /sys/block/vda/cache_type)
i=0
while [ $i -lt %[1]d ]; do
	t0=$(cut -d' ' -f1 /proc/uptime)
	out=$(dd if=/tmp/r of=/dev/vda bs=1M count=%[2]d oflag=direct 2>&1) || fail "dd run $i: $out"
	t1=$(cut -d' ' -f1 /proc/uptime)
	say DD n=$i bytes=$((%[2]d*1048576)) t0=$t0 t1=$t1
	phase ran$i
	i=$((i+1))
done
! dmesg | grep -iE 'I/O error|blk_update_request' || fail "I/O errors in the kernel log"
`, runs, count)
}

// run is one dd: its figure from dd's own clock (the guest's) and from
// the host's (the phase answers around it), and what reached the nodes.
type run struct {
	mode, cache string
	n           int
	ddSecs      float64 // by the guest's clock
	hostSecs    float64 // from the answer before it to the phase after it
	bytes       float64
	got         counts
}

// counts are what reached the nodes, summed over them: every replica
// counts.
type counts struct{ writes, sync, flushes float64 }

func (c counts) sub(o counts) counts {
	return counts{c.writes - o.writes, c.sync - o.sync, c.flushes - o.flushes}
}

// boot runs one guest with cfg (ddScript with runs runs) and returns its
// runs.
func boot(cfg guest.Config, mode string, runs int, addrs []string) ([]run, error) {
	dir, err := os.MkdirTemp("", "guestdd-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	cfg.Dir = dir
	ctx := context.Background()
	vm, err := guest.Start(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer vm.Close()
	fail := func(err error) ([]run, error) {
		return nil, fmt.Errorf("%w\nconsole:\n%s", err, vm.Console())
	}
	e, err := vm.Phase(ctx, "ready")
	if err != nil {
		return fail(err)
	}
	seen := strings.ReplaceAll(e.Args["cache"], "_", " ")
	want := map[string]string{"writeback": "write back", "writethrough": "write through"}[cfg.Cache]
	if seen != want {
		return fail(fmt.Errorf("drive cache=%s: the guest's cache_type is %q, want %q", cfg.Cache, seen, want))
	}
	fmt.Fprintf(os.Stderr, "guestdd: %s booted in %v (%s)\n", mode, vm.Elapsed().Round(100*time.Millisecond), vm.Accel())
	var out []run
	prev, err := readCounts(addrs)
	if err != nil {
		return fail(err)
	}
	for i := 0; i < runs; i++ {
		if err := vm.Continue(); err != nil {
			return fail(err)
		}
		start := time.Now()
		var dd guest.Event
		for dd.Kind != "DD" {
			if dd, err = vm.Next(ctx); err != nil {
				return fail(err)
			}
			if dd.Kind == "FAIL" || dd.Kind == "DONE" || dd.Kind == "PHASE" {
				return fail(fmt.Errorf("run %d: waiting for dd, got %q", i, dd.Line))
			}
		}
		if _, err := vm.Phase(ctx, fmt.Sprintf("ran%d", i)); err != nil {
			return fail(err)
		}
		host := time.Since(start).Seconds()
		now, err := readCounts(addrs)
		if err != nil {
			return fail(err)
		}
		bytes, secs, err := parseDD(dd)
		if err != nil {
			return fail(err)
		}
		r := run{mode: mode, cache: cfg.Cache, n: i, ddSecs: secs, hostSecs: host, bytes: bytes, got: now.sub(prev)}
		fmt.Fprintf(os.Stderr, "guestdd: %s run %d: %.1f MB/s (dd), %.1f MB/s (host); nodes: %.0f writes, %.0f sync, %.0f flushes\n",
			mode, i, bytes/secs/1e6, bytes/host/1e6, r.got.writes, r.got.sync, r.got.flushes)
		out = append(out, r)
		prev = now
	}
	if err := vm.Continue(); err != nil {
		return fail(err)
	}
	if err := vm.Wait(ctx); err != nil {
		return fail(err)
	}
	return out, nil
}

// parseDD reads a DD line's bytes and the guest's uptime before and
// after (busybox's dd prints no timing; /proc/uptime has 10 ms steps).
func parseDD(e guest.Event) (bytes, secs float64, err error) {
	v := map[string]float64{}
	for _, k := range []string{"bytes", "t0", "t1"} {
		if v[k], err = strconv.ParseFloat(e.Args[k], 64); err != nil {
			return 0, 0, fmt.Errorf("dd's line %q: %s: %w", e.Line, k, err)
		}
	}
	if secs = v["t1"] - v["t0"]; secs <= 0 {
		return 0, 0, fmt.Errorf("dd's line %q: no time passed", e.Line)
	}
	return v["bytes"], secs, nil
}

// readCounts sums the nodes' write, sync-write and flush counters.
func readCounts(addrs []string) (counts, error) {
	var c counts
	for _, a := range addrs {
		m, err := scrape(a)
		if err != nil {
			return c, err
		}
		c.writes += m[`ovis_node_requests_total{op="write",status="ok"}`] + m[`ovis_node_requests_total{op="write-zeroes",status="ok"}`]
		c.sync += m["ovis_node_sync_writes_total"]
		c.flushes += m["ovis_node_flushes_total"]
	}
	return c, nil
}

// scrape reads one node's metrics as "name{labels}" → value.
func scrape(addr string) (map[string]float64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "GET", "http://"+addr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("metrics of %s: %w", addr, err)
	}
	defer resp.Body.Close()
	m := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		l := sc.Text()
		if strings.HasPrefix(l, "#") {
			continue
		}
		i := strings.LastIndexByte(l, ' ')
		if i < 0 {
			continue
		}
		if v, err := strconv.ParseFloat(l[i+1:], 64); err == nil {
			m[l[:i]] += v
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("metrics of %s: %w", addr, err)
	}
	return m, nil
}

func printRuns(rs []run) {
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "mode\tdrive cache\trun\tMB/s (dd)\tMB/s (host)\tnode writes\tsync\tflushes\t")
	for _, r := range rs {
		fmt.Fprintf(w, "%s\t%s\t%d\t%.1f\t%.1f\t%.0f\t%.0f\t%.0f\t\n", r.mode, r.cache, r.n, r.bytes/r.ddSecs/1e6, r.bytes/r.hostSecs/1e6, r.got.writes, r.got.sync, r.got.flushes)
	}
	w.Flush()
}

// printSummary gives per mode the mean (as Sheepdog averaged), the
// median and the spread of dd's figures, and the ratios to emulated.
func printSummary(rs []run) {
	by := map[string][]float64{}
	host := map[string][]float64{}
	var order []string
	for _, r := range rs {
		if by[r.mode] == nil {
			order = append(order, r.mode)
		}
		by[r.mode] = append(by[r.mode], r.bytes/r.ddSecs/1e6)
		host[r.mode] = append(host[r.mode], r.bytes/r.hostSecs/1e6)
	}
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "mode\truns\tmean MB/s\tmedian\tmin-max\tmedian (host clock)\tmean/emulated's\t")
	for _, m := range order {
		v := by[m]
		ratio := "-"
		if e := by["emulated"]; len(e) > 0 {
			ratio = fmt.Sprintf("%.2f", mean(v)/mean(e))
		}
		fmt.Fprintf(w, "%s\t%d\t%.1f\t%.1f\t%.1f-%.1f\t%.1f\t%s\t\n", m, len(v), mean(v), median(v), slices.Min(v), slices.Max(v), median(host[m]), ratio)
	}
	w.Flush()
}

func mean(v []float64) float64 {
	s := 0.0
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if n := len(s); n%2 == 1 {
		return s[n/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return strings.Join(strings.Fields(string(b))[:3], " ")
}
