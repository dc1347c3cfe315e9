package routing

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/authn"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

func TestFallbackChain(t *testing.T) {
	groups := map[string]*configv1.ModelGroup{
		"a": {Name: "a", Fallbacks: []string{"b", "c"}},
		"b": {Name: "b", Fallbacks: []string{"d", "a"}}, // a cycle a snapshot should not hold: followed once
		"c": {Name: "c"},
		"d": {Name: "d", Fallbacks: []string{"gone"}},
	}
	look := func(n string) *configv1.ModelGroup { return groups[n] }
	p := &authn.Principal{Key: &configv1.Key{}}
	require.Equal(t, []string{"b", "c", "d", "gone"}, FallbackChain(p, "a", look), "breadth first, each once, an unknown one listed")
	require.Empty(t, FallbackChain(p, "c", look))

	p.Team = &configv1.Team{Fallbacks: map[string]*configv1.ModelGroupFallbacks{"a": {ModelGroups: []string{"c"}}}}
	require.Equal(t, []string{"c"}, FallbackChain(p, "a", look), "the team's override")
	p.Key.Fallbacks = map[string]*configv1.ModelGroupFallbacks{"a": {ModelGroups: []string{"d"}}, "d": {}}
	require.Equal(t, []string{"d"}, FallbackChain(p, "a", look), "the key's override wins; an empty list stops the chain")

	long := map[string]*configv1.ModelGroup{}
	prev := "g0"
	for i := 1; i <= 20; i++ {
		n := "g" + string(rune('a'+i))
		long[prev] = &configv1.ModelGroup{Name: prev, Fallbacks: []string{n}}
		prev = n
	}
	chain := FallbackChain(&authn.Principal{}, "g0", func(n string) *configv1.ModelGroup { return long[n] })
	require.Len(t, chain, MaxFallbackChain)
}
