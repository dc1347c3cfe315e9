package routing

import (
	"github.com/sluicegw/sluice/dataplane/internal/authn"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// MaxFallbackChain bounds the model groups a request may try after its
// own: the admin API refuses cycles, and this bound (with the visited set)
// keeps a chain finite whatever a snapshot holds.
const MaxFallbackChain = 8

// FallbacksOf returns the ordered fallbacks of group for principal p: the
// key's override for that group, else the team's, else the group's own
// list (g is the group's snapshot entry, nil when unknown). An override
// with an empty list turns fallbacks off for the group.
func FallbacksOf(p *authn.Principal, group string, g *configv1.ModelGroup) []string {
	if fb, ok := p.Key.GetFallbacks()[group]; ok {
		return fb.GetModelGroups()
	}
	if fb, ok := p.Team.GetFallbacks()[group]; ok {
		return fb.GetModelGroups()
	}
	return g.GetFallbacks()
}

// FallbackChain returns the model groups to try after primary, in order:
// primary's fallbacks, then theirs (breadth first), each group once,
// primary never, at most MaxFallbackChain. groups looks a group up in the
// snapshot (nil: unknown; an unknown group is still listed so that the
// caller can say it was skipped, but its own fallbacks are not followed).
func FallbackChain(p *authn.Principal, primary string, groups func(string) *configv1.ModelGroup) []string {
	seen := map[string]bool{primary: true}
	var chain []string
	queue := []string{primary}
	for len(queue) > 0 && len(chain) < MaxFallbackChain {
		g := queue[0]
		queue = queue[1:]
		for _, fb := range FallbacksOf(p, g, groups(g)) {
			if seen[fb] {
				continue
			}
			seen[fb] = true
			chain = append(chain, fb)
			if len(chain) == MaxFallbackChain {
				break
			}
			if groups(fb) != nil {
				queue = append(queue, fb)
			}
		}
	}
	return chain
}
