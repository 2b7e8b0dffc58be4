#include <immintrin.h>
#include <stdio.h>
#include <omp.h>
#include <time.h>
int main(){
  double t0=omp_get_wtime();
  long iters=200000000;
  float res=0;
  #pragma omp parallel reduction(+:res)
  {
    __m256 a[10]; __m256 b=_mm256_set1_ps(0.999999f), c=_mm256_set1_ps(1e-7f);
    for(int i=0;i<10;i++) a[i]=_mm256_set1_ps(i);
    for(long it=0; it<iters; it++){
      for(int i=0;i<10;i++) a[i]=_mm256_fmadd_ps(a[i],b,c);
    }
    __m256 s=a[0]; for(int i=1;i<10;i++) s=_mm256_add_ps(s,a[i]);
    float o[8]; _mm256_storeu_ps(o,s); res+=o[0];
  }
  double t=omp_get_wtime()-t0;
  int n=omp_get_max_threads();
  printf("threads %d: %.1f GFLOPS (%.3f s) %f\n", n, n*iters*10*16.0/t/1e9, t, res);
}
