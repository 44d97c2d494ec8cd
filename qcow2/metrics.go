package qcow2

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Collector exports an image's metadata-cache counters as Prometheus
// metrics, labelled with the image name and the cache (l2, refcount).
// Register it on the registry the caller owns.
type Collector struct {
	img  *Image
	name string

	hits, misses, evictions, writebacks, loads *prometheus.Desc
	entries, capacity, entryBytes              *prometheus.Desc
}

var _ prometheus.Collector = (*Collector)(nil)

// NewCollector returns a Collector for img, reported under name.
func NewCollector(img *Image, name string) *Collector {
	l := []string{"image", "cache"}
	d := func(n, help string) *prometheus.Desc { return prometheus.NewDesc("ovis_qcow2_cache_"+n, help, l, nil) }
	return &Collector{
		img: img, name: name,
		hits:       d("hits_total", "Lookups served from the metadata cache."),
		misses:     d("misses_total", "Lookups that had to read a table."),
		evictions:  d("evictions_total", "Tables dropped to make room or after idling."),
		writebacks: d("writebacks_total", "Dirty tables written back."),
		loads:      d("loads_total", "Table reads from the image file."),
		entries:    d("entries", "Tables cached now."),
		capacity:   d("capacity_entries", "Tables the cache holds at most."),
		entryBytes: d("entry_bytes", "Size of one cache entry (l2-cache-entry-size for L2)."),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.hits, c.misses, c.evictions, c.writebacks, c.loads, c.entries, c.capacity, c.entryBytes} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	l2, rc := c.img.CacheStats()
	for _, s := range []struct {
		name string
		st   CacheStats
	}{{"l2", l2}, {"refcount", rc}} {
		counter := func(d *prometheus.Desc, v uint64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), c.name, s.name)
		}
		gauge := func(d *prometheus.Desc, v int) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), c.name, s.name)
		}
		counter(c.hits, s.st.Hits)
		counter(c.misses, s.st.Misses)
		counter(c.evictions, s.st.Evictions)
		counter(c.writebacks, s.st.Writebacks)
		counter(c.loads, s.st.Loads)
		gauge(c.entries, s.st.Entries)
		gauge(c.capacity, s.st.Capacity)
		gauge(c.entryBytes, s.st.EntrySize)
	}
}
