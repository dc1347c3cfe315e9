package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

func TestParseDuration(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]time.Duration{
		"30d":   30 * 24 * time.Hour,
		"1d12h": 36 * time.Hour,
		"90m":   90 * time.Minute,
		"24h":   24 * time.Hour,
		"0d":    0,
	} {
		got, err := parseDuration(in)
		require.NoError(t, err, in)
		require.Equal(t, want, got, in)
	}
	for _, in := range []string{"", "d", "xd", "-1d", "1d2", "abc"} {
		_, err := parseDuration(in)
		require.Error(t, err, in)
	}
}

func TestParseTime(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 3, 1, 10, 0, 0, 0, time.UTC)
	for in, want := range map[string]time.Time{
		"2026-04-01T12:30:00Z":      time.Date(2026, 4, 1, 12, 30, 0, 0, time.UTC),
		"2026-04-01T12:30:00+02:00": time.Date(2026, 4, 1, 10, 30, 0, 0, time.UTC),
		"2026-04-01":                time.Date(2026, 4, 1, 0, 0, 0, 0, time.UTC),
		"30d":                       now.Add(30 * 24 * time.Hour),
		"12h":                       now.Add(12 * time.Hour),
		"never":                     {},
		"":                          {},
	} {
		got, err := parseTime(in, now)
		require.NoError(t, err, in)
		require.True(t, want.Equal(got), "%s: got %v, want %v", in, got, want)
	}
	for _, in := range []string{"tomorrow", "0s", "2026-13-01"} {
		_, err := parseTime(in, now)
		require.Error(t, err, in)
	}
}

func newTestFields() (*flag.FlagSet, *fields, *adminv1.Key) {
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	k := &adminv1.Key{}
	f := newFields(fs)
	keyFields(f, k)
	f.Clearable()
	return fs, f, k
}

func TestUpdateMaskNamesExactlyTheGivenFlags(t *testing.T) {
	t.Parallel()
	fs, f, k := newTestFields()
	require.NoError(t, fs.Parse([]string{"--rpm-limit", "10", "--tags", "a,b", "--tags", "c", "--clear", "expires", "--model-rpm-limit", "m=3"}))
	mask, err := f.updateMask()
	require.NoError(t, err)
	// Registration order, not command-line order.
	require.Equal(t, []string{"expire_time", "tags", "limits.rpm_limit", "limits.model_rpm_limit"}, mask.GetPaths())
	require.Equal(t, int64(10), k.GetLimits().GetRpmLimit())
	require.Equal(t, []string{"a", "b", "c"}, k.GetTags())
	require.Equal(t, map[string]int64{"m": 3}, k.GetLimits().GetModelRpmLimit())

	fs, f, _ = newTestFields()
	require.NoError(t, fs.Parse(nil))
	_, err = f.updateMask()
	require.ErrorContains(t, err, "nothing to update")

	fs, f, _ = newTestFields()
	require.NoError(t, fs.Parse([]string{"--rpm-limit", "1", "--clear", "rpm-limit"}))
	_, err = f.updateMask()
	require.ErrorContains(t, err, "--rpm-limit is both set and cleared")

	fs, f, _ = newTestFields()
	require.NoError(t, fs.Parse([]string{"--clear", "team"}))
	_, err = f.updateMask()
	require.ErrorContains(t, err, "--clear team: not a field of this command")

	// An empty list value clears the list (and is in the mask).
	fs, f, k = newTestFields()
	require.NoError(t, fs.Parse([]string{"--allowed-models", ""}))
	mask, err = f.updateMask()
	require.NoError(t, err)
	require.Equal(t, []string{"limits.allowed_models"}, mask.GetPaths())
	require.Empty(t, k.GetLimits().GetAllowedModels())
}

func TestFlagValueErrors(t *testing.T) {
	t.Parallel()
	for args, want := range map[string][]string{
		"int":      {"--rpm-limit", "abc"},
		"float":    {"--max-budget", "lots"},
		"map":      {"--metadata", "novalue"},
		"permodel": {"--model-max-budget", "gpt=x"},
		"class":    {"--traffic-class", "fast"},
		"time":     {"--expires", "soon"},
	} {
		fs, _, _ := newTestFields()
		require.Error(t, fs.Parse(want), args)
	}
	fs, _, k := newTestFields()
	require.NoError(t, fs.Parse([]string{"--max-budget", "$12.5", "--traffic-class", "BATCH", "--metadata", "a=b=c"}))
	require.Equal(t, 12.5, k.GetLimits().GetMaxBudget())
	require.Equal(t, adminv1.TrafficClass_TRAFFIC_CLASS_BATCH, k.GetTrafficClass())
	require.Equal(t, map[string]string{"a": "b=c"}, k.GetMetadata())
}

func TestCollectPages(t *testing.T) {
	t.Parallel()
	// 7 items served in pages of at most 3.
	fetch := func(_ context.Context, size int32, tok string) ([]int, string, error) {
		start := 0
		if tok != "" {
			start, _ = strconv.Atoi(tok)
		}
		n := min(int(size), 3, 7-start)
		items := make([]int, n)
		for i := range items {
			items[i] = start + i
		}
		next := ""
		if start+n < 7 {
			next = strconv.Itoa(start + n)
		}
		return items, next, nil
	}
	all, err := collect(t.Context(), 0, fetch)
	require.NoError(t, err)
	require.Equal(t, []int{0, 1, 2, 3, 4, 5, 6}, all)
	some, err := collect(t.Context(), 5, fetch)
	require.NoError(t, err)
	require.Equal(t, []int{0, 1, 2, 3, 4}, some)
	_, err = collect(t.Context(), 0, func(context.Context, int32, string) ([]int, string, error) { return []int{1}, "same", nil })
	require.ErrorContains(t, err, "same page token twice")
	_, err = collect(t.Context(), 0, func(context.Context, int32, string) ([]int, string, error) { return nil, "", fmt.Errorf("boom") })
	require.ErrorContains(t, err, "boom")
}

func TestEnumAndDetailFormatting(t *testing.T) {
	t.Parallel()
	require.Equal(t, "batch", trafficClass(adminv1.TrafficClass_TRAFFIC_CLASS_BATCH))
	require.Equal(t, "", trafficClass(adminv1.TrafficClass_TRAFFIC_CLASS_UNSPECIFIED))
	require.Equal(t, "org", enumName(adminv1.Scope_SCOPE_ORG.Descriptor(), adminv1.Scope_SCOPE_ORG.Number()))
	rpm := int64(5)
	var rows [][2]string
	detailRows((&adminv1.Team{Id: "t1", Limits: &adminv1.Limits{RpmLimit: &rpm, AllowedModels: []string{"a", "b"}}, ModelGroupAliases: map[string]string{"y": "2", "x": "1"}}).ProtoReflect(), "", &rows)
	require.Equal(t, [][2]string{
		{"id", "t1"}, {"limits.rpm_limit", "5"}, {"limits.allowed_models", "a, b"},
		{"blocked", "false"}, {"model_group_aliases", "x=1, y=2"},
	}, rows)
}
