package routing

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
)

func chat(t testing.TB, system string, turns ...string) *openai.Request {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, `{"model":"m","messages":[{"role":"system","content":%q}`, system)
	for _, u := range turns {
		fmt.Fprintf(&b, `,{"role":"user","content":%q}`, u)
	}
	b.WriteString(`]}`)
	r, e := openai.ParseRequest([]byte(b.String()))
	require.Nil(t, e)
	return r
}

func TestPrefixKey(t *testing.T) {
	long := strings.Repeat("You are a careful coding agent. ", 100) // 3.2 KB
	k1, ok := PrefixKey("/v1/chat/completions", chat(t, long, "first"))
	require.True(t, ok)
	// The conversation grows: same key.
	k2, ok := PrefixKey("/v1/chat/completions", chat(t, long, "first", "second", strings.Repeat("x", 10000)))
	require.True(t, ok)
	require.Equal(t, k1, k2)
	// Another system prompt: another key.
	k3, ok := PrefixKey("/v1/chat/completions", chat(t, "Other. "+long, "first"))
	require.True(t, ok)
	require.NotEqual(t, k1, k3)
	// Short prompts have none.
	_, ok = PrefixKey("/v1/chat/completions", chat(t, "short", "hi"))
	require.False(t, ok)
	// Tools come first: different tools, different key.
	r, e := openai.ParseRequest([]byte(`{"model":"m","tools":[{"type":"function","function":{"name":"a"}}],"messages":[{"role":"system","content":"` + long + `"}]}`))
	require.Nil(t, e)
	k4, ok := PrefixKey("/v1/chat/completions", r)
	require.True(t, ok)
	require.NotEqual(t, k1, k4)
	// Completions: the prompt.
	r, e = openai.ParseRequest([]byte(`{"model":"m","prompt":"` + long + `"}`))
	require.Nil(t, e)
	_, ok = PrefixKey("/v1/completions", r)
	require.True(t, ok)
}

func TestPrefixKeyReadsOnlyTheBlocks(t *testing.T) {
	a := []byte(strings.Repeat("a", PrefixBlocks*PrefixBlockSize))
	k1, ok := prefixKey(a)
	require.True(t, ok)
	k2, ok := prefixKey(a[:100], a[100:], []byte("anything after the blocks is never read"))
	require.True(t, ok)
	require.Equal(t, k1, k2)
	_, ok = prefixKey(a[:len(a)-1])
	require.False(t, ok)
}

func FuzzPrefixKey(f *testing.F) {
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`), 7)
	f.Add([]byte(`{"model":"m","tools":[],"messages":[{"role":"user","content":"`+strings.Repeat("z", 3000)+`"}]}`), 100)
	f.Fuzz(func(t *testing.T, body []byte, split int) {
		r, e := openai.ParseRequest(body)
		if e == nil {
			_, _ = PrefixKey("/v1/chat/completions", r)
			_, _ = PrefixKey("/v1/completions", r)
		}
		// Splitting the same bytes anywhere gives the same key.
		if split < 0 {
			split = -split
		}
		split %= len(body) + 1
		k1, ok1 := prefixKey(body)
		k2, ok2 := prefixKey(body[:split], body[split:])
		if ok1 != ok2 || k1 != k2 {
			t.Fatalf("split at %d changed the key", split)
		}
		if ok1 != (len(body) >= PrefixBlocks*PrefixBlockSize) {
			t.Fatalf("len %d: ok %v", len(body), ok1)
		}
	})
}

func TestBoundedRendezvous(t *testing.T) {
	cands := []Loaded{{ID: "a", Weight: 1}, {ID: "b", Weight: 1}, {ID: "c", Weight: 1}, {ID: "d", Weight: 1}}
	// Stable: the same key gives the same first choice; keys spread.
	firsts := map[string]int{}
	for k := uint64(0); k < 4000; k++ {
		o1, _ := BoundedRendezvous(k, cands, 0)
		o2, _ := BoundedRendezvous(k, cands, 0)
		require.Equal(t, o1, o2)
		firsts[cands[o1[0]].ID]++
	}
	for id, n := range firsts {
		require.InDelta(t, 1000, n, 150, "deployment %s got %d of 4000 keys", id, n)
	}
	// Removing one candidate moves only its own keys.
	moved := 0
	for k := uint64(0); k < 1000; k++ {
		o, _ := BoundedRendezvous(k, cands, 0)
		o3, _ := BoundedRendezvous(k, cands[:3], 0)
		if cands[o[0]].ID != "d" && cands[o[0]].ID != cands[o3[0]].ID {
			moved++
		}
	}
	require.Zero(t, moved)
	// Bounded load: the first choice above c × mean is skipped.
	key := uint64(42)
	o, over := BoundedRendezvous(key, cands, 1.25)
	require.False(t, over)
	hot := o[0]
	loaded := append([]Loaded(nil), cands...)
	loaded[hot].Load = 3
	o2, over := BoundedRendezvous(key, loaded, 1.25)
	require.True(t, over)
	require.NotEqual(t, hot, o2[0])
	require.Equal(t, hot, o2[len(o2)-1], "the overloaded one is still tried last")
	// A load within the bound keeps the choice.
	for i := range loaded {
		loaded[i].Load = 1
	}
	o3, over := BoundedRendezvous(key, loaded, 1.25)
	require.False(t, over)
	require.Equal(t, hot, o3[0])
}

func TestRendezvousWeights(t *testing.T) {
	cands := []Loaded{{ID: "a", Weight: 3}, {ID: "b", Weight: 1}}
	n := 0
	for k := uint64(0); k < 4000; k++ {
		if o, _ := BoundedRendezvous(k, cands, 0); o[0] == 0 {
			n++
		}
	}
	require.InDelta(t, 3000, n, 150)
}
