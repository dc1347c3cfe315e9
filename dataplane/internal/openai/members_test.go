package openai

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// membersBody is a request with model first and n members m0..m(n-1).
func membersBody(n int, extra string) []byte {
	var b bytes.Buffer
	b.WriteString(`{"model":"m"`)
	for i := range n {
		fmt.Fprintf(&b, `,"m%d":%d`, i, i)
	}
	b.WriteString(extra + `}`)
	return b.Bytes()
}

// firstDuplicate is the reference for the duplicate check: the name of
// the first top-level member (in body order) whose decoded name an earlier
// member has (dup: there is one); ok is false when body is no JSON object.
// It decodes with encoding/json's tokenizer.
func firstDuplicate(t testing.TB, body []byte) (name string, dup, ok bool) {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return "", false, false
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return "", false, false
		}
		name := tok.(string)
		if seen[name] {
			return name, true, true
		}
		seen[name] = true
		var v json.RawMessage
		if dec.Decode(&v) != nil {
			return "", false, false
		}
	}
	return "", false, true
}

// TestDuplicateMembers: past indexAfter members too, a member given twice
// (compared after decoding escapes) is refused naming the first repeat in
// body order, as a scan would; lookups find members anywhere.
func TestDuplicateMembers(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		body []byte
		dup  string
	}{
		{"none, many members", membersBody(1000, ""), ""},
		{"last repeats the first", membersBody(1000, `,"m0":1`), "m0"},
		{"repeat right past the scan", membersBody(indexAfter, `,"m3":1`), "m3"},
		{"escaped repeat", membersBody(100, `,"m\u0035":1`), "m5"},
		{"the first of two repeats in body order", membersBody(100, `,"m70":1,"m2":1`), "m70"},
		{"model repeated late", membersBody(100, `,"mod\u0065l":"x"`), "model"},
		{"within the scan", []byte(`{"model":"m","a":1,"a":2}`), "a"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want, _, ok := firstDuplicate(t, tc.body)
			require.True(t, ok)
			require.Equal(t, tc.dup, want, "reference")
			r, e := parseRequest(tc.body)
			if tc.dup == "" {
				require.Nil(t, e)
				require.Equal(t, "m", r.model)
				require.Equal(t, "999", string(r.value("m999")))
				require.Nil(t, r.value("m1000"))
				require.True(t, r.has("m500"))
				return
			}
			require.NotNil(t, e)
			require.Equal(t, CodeInvalidJSON, e.Code)
			require.Equal(t, tc.dup, e.Param)
			require.Equal(t, fmt.Sprintf("the request body has the member %q twice", tc.dup), e.Message)
		})
	}
	// Random bodies: the same answer as the reference.
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		n := rng.IntN(300)
		var b strings.Builder
		b.WriteString(`{"model":"m"`)
		for range n {
			k := rng.IntN(4*n/3 + 1)
			if rng.IntN(10) == 0 {
				fmt.Fprintf(&b, `,"\u006b%d":0`, k) // escaped "k"
			} else {
				fmt.Fprintf(&b, `,"k%d":0`, k)
			}
		}
		b.WriteString(`}`)
		body := []byte(b.String())
		want, dup, ok := firstDuplicate(t, body)
		require.True(t, ok)
		_, e := parseRequest(body)
		if !dup {
			require.Nil(t, e, "%s", body)
		} else {
			require.NotNil(t, e, "%s", body)
			require.Equal(t, want, e.Param, "%s", body)
		}
	}
}

// threadCPU is the CPU time of the calling thread (getrusage
// RUSAGE_THREAD); callers lock their goroutine to it.
func threadCPU(t testing.TB) time.Duration {
	var ru syscall.Rusage
	require.NoError(t, syscall.Getrusage(1 /* RUSAGE_THREAD */, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// parseCPU is the least thread CPU time of tries parses of body.
func parseCPU(t testing.TB, body []byte, tries int) time.Duration {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	best := time.Duration(1 << 62)
	for range tries {
		c0 := threadCPU(t)
		_, e := parseRequest(body)
		best = min(best, threadCPU(t)-c0)
		require.NotNil(t, e)
	}
	return best
}

// parseCPUEach is the mean thread CPU time of parsing body, over enough
// parses to add up to 200 ms (the thread clock may tick coarsely).
func parseCPUEach(t testing.TB, body []byte) time.Duration {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	c0, n := threadCPU(t), 0
	for ; n < 3 || threadCPU(t)-c0 < 200*time.Millisecond; n++ {
		_, e := parseRequest(body)
		require.NotNil(t, e)
	}
	return (threadCPU(t) - c0) / time.Duration(n)
}

// TestParseManyMembersCPU: a 100,000-member body (1.1 MB, the duplicate at
// its end) is parsed in under 50 ms of CPU, and the cost grows linearly:
// ten times the members, at most about ten times the CPU (quadratic was a
// hundred times; 100,000 members took 63 s).
func TestParseManyMembersCPU(t *testing.T) {
	budget := 50 * time.Millisecond
	if raceEnabled {
		budget *= 10
	}
	small, large := membersBody(20_000, `,"m0":1`), membersBody(200_000, `,"m0":1`)
	mid := membersBody(100_000, `,"m0":1`)
	cpu := parseCPU(t, mid, 5)
	t.Logf("100,000 members, %d bytes: %s of CPU", len(mid), cpu)
	require.Less(t, cpu, budget, "race detector: %v", raceEnabled)
	cs, cl := parseCPUEach(t, small), parseCPUEach(t, large)
	t.Logf("20,000 members: %s, 200,000: %s (×%.1f)", cs, cl, float64(cl)/float64(cs))
	require.Less(t, float64(cl)/float64(cs), 25.0, "10× the members cost more than 25× the CPU")
}

// BenchmarkParseRequestMembers: parse cost per body size with many
// members (duplicate at the end, so the whole body is checked).
func BenchmarkParseRequestMembers(b *testing.B) {
	for _, n := range []int{16, 1_000, 100_000} {
		body := membersBody(n, `,"m0":1`)
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				if _, e := parseRequest(body); e == nil {
					b.Fatal("duplicate not found")
				}
			}
		})
	}
}
