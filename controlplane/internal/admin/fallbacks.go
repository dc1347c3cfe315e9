package admin

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// Fallback model groups (SPEC §7.3, docs/resilience.md "Fallbacks"): a
// model group's ordered fallbacks, overridable per key and team. Every
// name must be an existing model group; a group never falls back to
// itself; the graph they form (the groups' lists with the overrides
// applied) has no cycle. A violation is InvalidArgument naming the field
// and the group.

// Bounds of fallback lists. maxFallbacks matches the data plane's chain
// bound (routing.MaxFallbackChain).
const (
	maxFallbacks         = 8
	maxFallbackOverrides = 100
)

// Resilience bounds.
const (
	minResilienceDuration = 100 * time.Millisecond
	maxResilienceDuration = time.Hour
	maxAttemptsBound      = 10
)

func fallbacksToProto(f store.Fallbacks) map[string]*adminv1.ModelGroupFallbacks {
	if len(f) == 0 {
		return nil
	}
	out := make(map[string]*adminv1.ModelGroupFallbacks, len(f))
	for g, list := range f {
		out[g] = &adminv1.ModelGroupFallbacks{ModelGroups: slices.Clone(list)}
	}
	return out
}

func fallbacksFromProto(m map[string]*adminv1.ModelGroupFallbacks) store.Fallbacks {
	out := make(store.Fallbacks, len(m))
	for g, list := range m {
		out[g] = nonNilStrings(list.GetModelGroups())
	}
	return out
}

func nonNilStrings(s []string) []string {
	if s == nil {
		return []string{}
	}
	return slices.Clone(s)
}

// validateFallbackList checks one list's shape: valid names, no
// duplicate, not the group itself, at most maxFallbacks.
func validateFallbackList(c *validator, field, group string, list []string) {
	if len(list) > maxFallbacks {
		c.add(field, "at most %d fallback model groups (got %d)", maxFallbacks, len(list))
		return
	}
	seen := map[string]bool{}
	for _, g := range list {
		switch {
		case !modelGroupNamePattern.MatchString(g):
			c.add(field, "model group name %q must be 1–100 characters of [A-Za-z0-9._:/-]", g)
		case g == group:
			c.add(field, "model group %q cannot fall back to itself", g)
		case seen[g]:
			c.add(field, "model group %q is listed twice", g)
		}
		seen[g] = true
	}
}

// validateFallbackOverrides checks a key's or team's overrides' shape.
func validateFallbackOverrides(c *validator, field string, m map[string]*adminv1.ModelGroupFallbacks) {
	if len(m) > maxFallbackOverrides {
		c.add(field, "at most %d model groups (got %d)", maxFallbackOverrides, len(m))
		return
	}
	for _, g := range sortedKeys(m) {
		if !modelGroupNamePattern.MatchString(g) {
			c.add(field, "model group name %q must be 1–100 characters of [A-Za-z0-9._:/-]", g)
			continue
		}
		validateFallbackList(c, fmt.Sprintf("%s[%q]", field, g), g, m[g].GetModelGroups())
	}
}

// checkFallbackGraph checks, inside tx, that the lists of overlay (model
// group → its fallbacks, replacing the stored ones) name existing groups
// and, applied over every group's stored fallbacks, form no cycle. It
// takes the fallback lock first so that two concurrent changes cannot
// close a cycle between them. field names the field in violations ("%s"
// is replaced by the overlay's group when the field is per group).
func checkFallbackGraph(ctx context.Context, tx *store.Tx, field func(group string) string, overlay map[string][]string) error {
	if err := tx.FallbacksLock(ctx); err != nil {
		return err
	}
	graph, err := tx.ModelGroupFallbackGraph(ctx)
	if err != nil {
		return err
	}
	c := &validator{}
	for _, g := range sortedKeys(overlay) {
		if _, ok := graph[g]; !ok {
			c.add(field(g), "unknown model group %q", g)
		}
		for _, fb := range overlay[g] {
			if _, ok := graph[fb]; !ok {
				c.add(field(g), "unknown model group %q", fb)
			}
		}
	}
	if err := c.err(); err != nil {
		return err
	}
	for g, list := range overlay {
		graph[g] = list
	}
	for _, g := range sortedKeys(overlay) {
		if cyc := fallbackCycle(graph, g); cyc != nil {
			c.add(field(g), "the fallbacks form a cycle: %s", strings.Join(cyc, " → "))
		}
	}
	return c.err()
}

// fallbackCycle returns a cycle through start in graph (start → … →
// start), nil when there is none.
func fallbackCycle(graph map[string][]string, start string) []string {
	var path []string
	onPath := map[string]bool{}
	done := map[string]bool{}
	var visit func(g string) []string
	visit = func(g string) []string {
		if onPath[g] {
			if g != start {
				return nil // a cycle not through start: reported for its own group
			}
			return append(slices.Clone(path), g)
		}
		if done[g] {
			return nil
		}
		onPath[g] = true
		path = append(path, g)
		for _, fb := range graph[g] {
			if cyc := visit(fb); cyc != nil {
				return cyc
			}
		}
		path = path[:len(path)-1]
		onPath[g] = false
		done[g] = true
		return nil
	}
	return visit(start)
}

// validateResilience checks a model group's resilience settings.
func validateResilience(c *validator, field string, r *adminv1.ModelGroupResilience) {
	if r == nil {
		return
	}
	dur := func(name string, ms int64) {
		d := time.Duration(ms) * time.Millisecond
		if ms != 0 && (ms < 0 || d < minResilienceDuration || d > maxResilienceDuration) {
			c.add(field+"."+name, "must be 0 (the proxy's flag) or between %s and %s (got %d ms)", minResilienceDuration, maxResilienceDuration, ms)
		}
	}
	dur("ttft_timeout_ms", r.GetTtftTimeoutMs())
	dur("ejection_base_ms", r.GetEjectionBaseMs())
	dur("ejection_max_ms", r.GetEjectionMaxMs())
	if b, m := r.GetEjectionBaseMs(), r.GetEjectionMaxMs(); b > 0 && m > 0 && b > m {
		c.add(field+".ejection_max_ms", "must not be below ejection_base_ms (%d ms > %d ms)", b, m)
	}
	if n := r.GetMaxAttempts(); n < 0 || n > maxAttemptsBound {
		c.add(field+".max_attempts", "must be 0 (the proxy's flag) or between 1 and %d (got %d)", maxAttemptsBound, n)
	}
	if p := r.GetPanicThresholdPercent(); p < 0 || p > 100 {
		c.add(field+".panic_threshold_percent", "must be 0 (the proxy's flag) or between 1 and 100 (got %d)", p)
	}
}

// resilienceJSON is the stored form of r ("{}" for none).
func resilienceJSON(r *adminv1.ModelGroupResilience) []byte {
	if r == nil || proto.Size(r) == 0 {
		return []byte("{}")
	}
	b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(r)
	if err != nil {
		panic(err) // a message of scalars always marshals
	}
	return b
}

func resilienceFromJSON(b []byte) (*adminv1.ModelGroupResilience, error) {
	r := &adminv1.ModelGroupResilience{}
	if len(b) > 0 {
		if err := protojson.Unmarshal(b, r); err != nil {
			return nil, fmt.Errorf("decode resilience settings: %w", err)
		}
	}
	if proto.Size(r) == 0 {
		return nil, nil
	}
	return r, nil
}

// setOverrides stores a key's or team's fallback overrides through set
// when after differs from before, after checking every overridden group
// against the model groups: the names exist and no cycle forms.
func setOverrides(ctx context.Context, tx *store.Tx, before, after map[string]*adminv1.ModelGroupFallbacks, set func(store.Fallbacks) error) error {
	if fallbacksEqual(before, after) {
		return nil
	}
	f := fallbacksFromProto(after)
	if len(f) > 0 {
		if err := checkFallbackGraph(ctx, tx, func(g string) string { return fmt.Sprintf("fallbacks[%q]", g) }, f); err != nil {
			return err
		}
	}
	return set(f)
}

func fallbacksEqual(a, b map[string]*adminv1.ModelGroupFallbacks) bool {
	if len(a) != len(b) {
		return false
	}
	for g, l := range a {
		o, ok := b[g]
		if !ok || !slices.Equal(l.GetModelGroups(), o.GetModelGroups()) {
			return false
		}
	}
	return true
}
