package admin

import (
	"fmt"
	"math"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// ValidationError lists every invalid field of a request; it maps to
// InvalidArgument and its message names each field.
type ValidationError struct {
	Violations []Violation
}

// Violation is one invalid field.
type Violation struct {
	Field string
	Desc  string
}

func (e *ValidationError) Error() string {
	parts := make([]string, len(e.Violations))
	for i, v := range e.Violations {
		parts[i] = v.Field + ": " + v.Desc
	}
	return "invalid request: " + strings.Join(parts, "; ")
}

// validator collects violations.
type validator struct{ v []Violation }

func (c *validator) add(field, format string, args ...any) {
	c.v = append(c.v, Violation{Field: field, Desc: fmt.Sprintf(format, args...)})
}

func (c *validator) err() error {
	if len(c.v) == 0 {
		return nil
	}
	return &ValidationError{Violations: c.v}
}

func invalid(field, format string, args ...any) error {
	c := &validator{}
	c.add(field, format, args...)
	return c.err()
}

// Level is a tenancy level; levels differ in which limit fields they take.
type Level int

// Levels.
const (
	LevelOrg Level = iota + 1
	LevelTeam
	LevelMember
	LevelUser
	LevelKey
	LevelCustomer
	// LevelProject and LevelTag are the project and tag scopes
	// (LabelScope).
	LevelProject
	LevelTag
)

func (l Level) String() string {
	return [...]string{"", "orgs", "teams", "team members", "users", "keys", "customers", "projects", "tags"}[l]
}

// Limit bounds: large enough for any real deployment, small enough that an
// accidental extra digit is caught.
const (
	maxBudgetUSD    = 1e9
	maxRateLimit    = 1e12
	maxParallel     = 1e6
	maxModelNameLen = 200
	maxListLen      = 1000
)

var durationPattern = regexp.MustCompile(`^([1-9][0-9]{0,3})(h|d|mo)$`)

// ParseBudgetDuration checks a budget window: "<n>h" (1–8784), "<n>d"
// (1–366) — rolling windows — or "<n>mo" (1–12), calendar months in UTC.
func ParseBudgetDuration(s string) error {
	m := durationPattern.FindStringSubmatch(s)
	if m == nil {
		return fmt.Errorf("%q is not a budget window: want <n>h, <n>d or <n>mo, e.g. 1d, 30d, 1mo", s)
	}
	n, _ := strconv.Atoi(m[1])
	maxN := map[string]int{"h": 8784, "d": 366, "mo": 12}[m[2]]
	if n > maxN {
		return fmt.Errorf("%q is too long: at most %d%s", s, maxN, m[2])
	}
	return nil
}

func validMoney(c *validator, field string, v float64) {
	switch {
	case math.IsNaN(v) || math.IsInf(v, 0):
		c.add(field, "must be a finite number")
	case v <= 0:
		c.add(field, "must be > 0 (got %g); leave it unset for no limit", v)
	case v > maxBudgetUSD:
		c.add(field, "must be at most %g USD (got %g)", float64(maxBudgetUSD), v)
	}
}

func validCount(c *validator, field string, v int64, maxV float64) {
	switch {
	case v <= 0:
		c.add(field, "must be > 0 (got %d); leave it unset for no limit", v)
	case float64(v) > maxV:
		c.add(field, "must be at most %g (got %d)", maxV, v)
	}
}

func validModelName(c *validator, field, name string) {
	if name == "" || len(name) > maxModelNameLen || !utf8.ValidString(name) || strings.TrimSpace(name) != name {
		c.add(field, "model name %q must be 1–%d characters without surrounding spaces", name, maxModelNameLen)
	}
}

// validateLimits checks l for level lvl; prefix is the field path ("limits").
// extraBudget is set for team members, whose budget is max_budget_in_team.
func validateLimits(c *validator, prefix string, l *adminv1.Limits, lvl Level, extraBudget *float64) {
	if l == nil {
		l = &adminv1.Limits{}
	}
	f := func(name string) string { return prefix + "." + name }
	if l.MaxBudget != nil {
		if lvl == LevelMember {
			c.add(f("max_budget"), "not supported on team members; use max_budget_in_team")
		} else {
			validMoney(c, f("max_budget"), *l.MaxBudget)
		}
	}
	if extraBudget != nil {
		validMoney(c, "max_budget_in_team", *extraBudget)
	}
	if l.SoftBudget != nil {
		validMoney(c, f("soft_budget"), *l.SoftBudget)
		hard := l.MaxBudget
		if extraBudget != nil {
			hard = extraBudget
		}
		if hard != nil && *l.SoftBudget > *hard {
			c.add(f("soft_budget"), "must not exceed the hard budget (%g > %g)", *l.SoftBudget, *hard)
		}
	}
	hasBudget := l.MaxBudget != nil || l.SoftBudget != nil || extraBudget != nil || len(l.ModelMaxBudget) > 0
	switch {
	case l.BudgetDuration != "":
		if err := ParseBudgetDuration(l.BudgetDuration); err != nil {
			c.add(f("budget_duration"), "%v", err)
		}
	case hasBudget:
		c.add(f("budget_duration"), "required when a budget is set (e.g. 30d or 1mo)")
	}
	if l.RpmLimit != nil {
		validCount(c, f("rpm_limit"), *l.RpmLimit, maxRateLimit)
	}
	if l.TpmLimit != nil {
		validCount(c, f("tpm_limit"), *l.TpmLimit, maxRateLimit)
	}
	if l.MaxParallelRequests != nil {
		validCount(c, f("max_parallel_requests"), *l.MaxParallelRequests, maxParallel)
	}
	perModel := lvl == LevelKey || lvl == LevelTeam
	if len(l.AllowedModels) > 0 {
		switch lvl {
		case LevelMember:
			c.add(f("allowed_models"), "not supported on team members; set it on the team or the key")
		case LevelProject, LevelTag:
			c.add(f("allowed_models"), "not supported on %s (they limit usage, they do not grant or narrow models); set it on the key or its team", lvl)
		}
		if len(l.AllowedModels) > maxListLen {
			c.add(f("allowed_models"), "at most %d entries", maxListLen)
		}
		seen := map[string]bool{}
		for i, m := range l.AllowedModels {
			validModelName(c, fmt.Sprintf("%s[%d]", f("allowed_models"), i), m)
			if seen[m] {
				c.add(fmt.Sprintf("%s[%d]", f("allowed_models"), i), "duplicate model %q", m)
			}
			seen[m] = true
		}
	}
	checkMap := func(name string, n int, each func()) {
		if n == 0 {
			return
		}
		if !perModel {
			c.add(f(name), "per-model limits are supported on keys and teams only, not on %s", lvl)
			return
		}
		each()
	}
	checkMap("model_max_budget", len(l.ModelMaxBudget), func() {
		for _, m := range sortedKeys(l.ModelMaxBudget) {
			validModelName(c, f("model_max_budget"), m)
			validMoney(c, f("model_max_budget")+"["+m+"]", l.ModelMaxBudget[m])
		}
	})
	checkMap("model_rpm_limit", len(l.ModelRpmLimit), func() {
		for _, m := range sortedKeys(l.ModelRpmLimit) {
			validModelName(c, f("model_rpm_limit"), m)
			validCount(c, f("model_rpm_limit")+"["+m+"]", l.ModelRpmLimit[m], maxRateLimit)
		}
	})
	checkMap("model_tpm_limit", len(l.ModelTpmLimit), func() {
		for _, m := range sortedKeys(l.ModelTpmLimit) {
			validModelName(c, f("model_tpm_limit"), m)
			validCount(c, f("model_tpm_limit")+"["+m+"]", l.ModelTpmLimit[m], maxRateLimit)
		}
	})
	switch l.RateLimitFallback {
	case "", "closed", "local":
	default:
		c.add(f("rate_limit_fallback"), "must be \"closed\", \"local\" or empty (the data plane's default), got %q", l.RateLimitFallback)
	}
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// validateName checks a required display name.
func validateName(c *validator, field, s string, maxLen int) {
	if strings.TrimSpace(s) == "" {
		c.add(field, "required")
		return
	}
	if utf8.RuneCountInString(s) > maxLen || !utf8.ValidString(s) {
		c.add(field, "must be at most %d characters", maxLen)
	}
}

// validateMetadata bounds metadata.
func validateMetadata(c *validator, md map[string]string) {
	if len(md) > 64 {
		c.add("metadata", "at most 64 entries (got %d)", len(md))
	}
	for k, v := range md {
		if k == "" || len(k) > 100 {
			c.add("metadata", "keys must be 1–100 bytes (got %q)", k)
		}
		if len(v) > 1000 {
			c.add("metadata["+k+"]", "values must be at most 1000 bytes")
		}
	}
}

// validateAliases checks a model group alias map.
func validateAliases(c *validator, field string, m map[string]string) {
	if len(m) > maxListLen {
		c.add(field, "at most %d entries", maxListLen)
	}
	for _, k := range sortedKeys(m) {
		validModelName(c, field+" key", k)
		validModelName(c, field+"["+k+"]", m[k])
	}
}

func validateTrafficClass(c *validator, field string, tc adminv1.TrafficClass) {
	if _, ok := adminv1.TrafficClass_name[int32(tc)]; !ok {
		c.add(field, "unknown traffic class %d", tc)
	}
}

// limitsJSON encodes limits for storage (proto field names).
func limitsJSON(l *adminv1.Limits) []byte {
	if l == nil {
		return []byte("{}")
	}
	b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(l)
	if err != nil {
		panic(err) // a generated message always marshals
	}
	return b
}

// limitsFromJSON decodes stored limits.
func limitsFromJSON(b []byte) (*adminv1.Limits, error) {
	l := &adminv1.Limits{}
	if len(b) == 0 {
		return l, nil
	}
	if err := protojson.Unmarshal(b, l); err != nil {
		return nil, fmt.Errorf("decode stored limits: %w", err)
	}
	return l, nil
}

// auditJSON encodes an API object for the audit trail. API objects never
// carry secrets (tokens are only in Create/Rotate responses).
func auditJSON(m proto.Message) []byte {
	if m == nil {
		return nil
	}
	b, err := protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: false}.Marshal(m)
	if err != nil {
		panic(err)
	}
	return b
}
