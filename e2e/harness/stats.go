package harness

import (
	"bufio"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Percentile is the nearest-rank p-th percentile (0 < p ≤ 100) of d: the
// smallest sample with at least p% of the samples at or below it (0 for no
// samples). d is not modified.
func Percentile(d []time.Duration, p float64) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(math.Ceil(p*float64(len(s))/100)) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// SSETiming is what ReadSSETiming measured on one stream.
type SSETiming struct {
	// TTFT is the time from the request's start to the first chunk.
	TTFT time.Duration
	// Chunks is the number of chunks carrying a send time.
	Chunks int
	// MeanDelay is the mean relay delay of those chunks (arrival −
	// upstream send time).
	MeanDelay time.Duration
}

// ReadSSETiming reads an SSE stream to its end and times its chunks:
// start is when the request was sent; a chunk counts when its line carries
// the upstream's send time as a trailing `"sent":<unix nanos>}` field (the
// benchmark upstreams write it), other lines are skipped.
func ReadSSETiming(r io.Reader, start time.Time) (SSETiming, error) {
	sc := bufio.NewScanner(r)
	var st SSETiming
	var total time.Duration
	for sc.Scan() {
		line := sc.Text()
		i := strings.Index(line, `"sent":`)
		if i < 0 {
			continue
		}
		now := time.Now()
		if st.Chunks == 0 {
			st.TTFT = now.Sub(start)
		}
		sent, _ := strconv.ParseInt(strings.TrimSuffix(line[i+len(`"sent":`):], "}"), 10, 64)
		total += now.Sub(time.Unix(0, sent))
		st.Chunks++
	}
	if st.Chunks > 0 {
		st.MeanDelay = total / time.Duration(st.Chunks)
	}
	return st, sc.Err()
}
